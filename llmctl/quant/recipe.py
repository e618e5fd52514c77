"""Quantization recipes: YAML in llm-compressor's shape, validated into typed modifiers.

    quant_stage:                     # any key ending in ``_stage``
      quant_modifiers:               # any key ending in ``_modifiers``
        GPTQModifier:                # a modifier from MODIFIERS
          scheme: W4A16              # or config_groups / a {PRESET: targets} mapping
          targets: [Linear]
          ignore: [lm_head]

Every model forbids unknown keys, so a typo fails naming the key and the keys allowed
there. Quantization schemes are compressed-tensors' own ``QuantizationScheme`` /
``QuantizationArgs``, the same objects the output's ``quantization_config`` holds.
Fields llm-compressor has that do not change llmctl's result (``sequential_targets``,
``offload_hessians``, ``offload_device``, ``num_calibration_steps``) are accepted so
recipes carry over; they are listed in ``recipes/README.md``.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from llmctl.errors import ConfigError, MissingDependencyError

try:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
except ImportError:  # pragma: no cover - the quant extra is part of the default install
    QuantizationArgs = QuantizationScheme = None  # type: ignore[assignment,misc]
    PRESET_SCHEMES = {}

# The presets llmctl implements (a subset of compressed-tensors' table).
SUPPORTED_PRESETS = ("W4A16", "W4A16_ASYM", "W8A16", "W8A8", "INT8", "FP8", "FP8_DYNAMIC")

# llm-compressor's default Llama-family mappings.
DEFAULT_AWQ_MAPPINGS = [
    {"smooth_layer": "re:.*input_layernorm$",
     "balance_layers": ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]},
    {"smooth_layer": "re:.*v_proj$", "balance_layers": ["re:.*o_proj$"]},
    {"smooth_layer": "re:.*post_attention_layernorm$",
     "balance_layers": ["re:.*gate_proj$", "re:.*up_proj$"]},
    {"smooth_layer": "re:.*up_proj$", "balance_layers": ["re:.*down_proj$"]},
]
DEFAULT_SMOOTHQUANT_MAPPINGS = [
    [["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"],
    [["re:.*gate_proj", "re:.*up_proj"], "re:.*post_attention_layernorm"],
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


class _QuantizationFields(_Strict):
    """What llm-compressor's QuantizationMixin accepts: which modules, which scheme."""

    targets: list[str] = Field(default_factory=lambda: ["Linear"])
    ignore: list[str] = Field(default_factory=list)
    scheme: str | dict[str, list[str]] | None = None
    config_groups: dict[str, QuantizationScheme] | None = None  # type: ignore[valid-type]
    # static FP8 (E4M3) K/V scales per layer ("tensor") or per KV head ("attn_head"),
    # calibrated with the weights and written as self_attn.k_scale / v_scale
    kv_cache_scheme: QuantizationArgs | None = None  # type: ignore[valid-type]
    sequential_targets: str | list[str] | None = None  # accepted; llmctl is always per layer
    # mixtures of experts (llmctl keys; llm-compressor's moe_calibrate_all_experts): every
    # calibration token goes through every expert for the statistics only (the block's
    # output keeps the real routing). Off: each expert's statistics come from the tokens
    # routed to it, and one routed fewer than min_expert_tokens is quantized
    # round-to-nearest, with a warning naming it.
    calibrate_all_experts: bool = True
    min_expert_tokens: int = Field(1, ge=1)

    @field_validator("targets", "ignore", mode="before")
    @classmethod
    def _listify(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("kv_cache_scheme")
    @classmethod
    def _static_fp8_kv(cls, value: Any) -> Any:
        if value is None:
            return value
        strategy = getattr(value.strategy, "value", value.strategy)
        if (value.num_bits, getattr(value.type, "value", value.type)) != (8, "float") \
                or value.dynamic or not value.symmetric or strategy not in ("tensor", "attn_head"):
            raise ValueError("kv_cache_scheme: llmctl writes static symmetric FP8 K/V scales "
                             "only (num_bits: 8, type: float, dynamic: false, symmetric: true, "
                             "strategy: tensor or attn_head)")
        return value

    @field_validator("scheme")
    @classmethod
    def _known_presets(cls, value: Any) -> Any:
        names = [value] if isinstance(value, str) else list(value or {})
        for name in names:
            if name.upper() not in SUPPORTED_PRESETS:
                raise ValueError(f"unknown scheme preset {name!r}; "
                                 f"llmctl supports: {', '.join(SUPPORTED_PRESETS)}")
        return value

    def resolved_groups(self) -> dict[str, Any]:
        """Config groups (name -> QuantizationScheme), from whichever form was given."""
        if self.config_groups and self.scheme:
            raise ConfigError("a modifier sets both `scheme` and `config_groups`",
                              "keep one: a preset name or explicit config_groups")
        if self.config_groups:
            return dict(self.config_groups)
        if isinstance(self.scheme, str):
            return {"group_0": _preset(self.scheme, self.targets)}
        if isinstance(self.scheme, dict):
            return {f"group_{i}": _preset(name, targets)
                    for i, (name, targets) in enumerate(self.scheme.items())}
        raise ConfigError("the quantization modifier has no scheme",
                          "add `scheme: W4A16` (or another preset) or `config_groups`")


def _preset(name: str, targets: list[str]):
    from copy import deepcopy

    return QuantizationScheme(targets=list(targets), **deepcopy(PRESET_SCHEMES[name.upper()]))


class QuantizationModifier(_QuantizationFields):
    """Round-to-nearest weights (minmax or mse observer), plus activation settings."""


class GPTQModifier(_QuantizationFields):
    block_size: int = Field(128, ge=1)
    dampening_frac: float = Field(0.01, gt=0)
    actorder: Literal["static", "weight", "group", "dynamic"] | None = "static"
    offload_hessians: bool = False  # accepted; Hessians are per layer and small here


class AWQMapping(_Strict):
    smooth_layer: str
    balance_layers: list[str]


class AWQModifier(_QuantizationFields):
    mappings: list[AWQMapping] | None = None
    duo_scaling: bool = True
    n_grid: int = Field(20, ge=1)
    offload_device: str | None = None  # accepted; no effect
    # llmctl extensions (not llm-compressor keys): AutoAWQ's clipping search, and the
    # scale-search objective (whole attention/MLP block output on a token subset, or the
    # balanced linears' own output error on every token).
    apply_clip: bool = True
    max_shrink: float = Field(0.5, gt=0, lt=1)
    objective: Literal["block", "linear"] = "block"
    objective_tokens: int = Field(2048, ge=1)

    def resolved_mappings(self) -> list[AWQMapping]:
        return self.mappings or [AWQMapping(**m) for m in DEFAULT_AWQ_MAPPINGS]


class SmoothQuantModifier(_Strict):
    smoothing_strength: float = Field(0.5, ge=0, le=1)
    mappings: list[tuple[list[str], str]] | None = None
    ignore: list[str] = Field(default_factory=list)
    num_calibration_steps: int | None = None  # accepted; every calibration sample is used

    def resolved_mappings(self) -> list[tuple[list[str], str]]:
        return [tuple(m) for m in (self.mappings or DEFAULT_SMOOTHQUANT_MAPPINGS)]


MODIFIERS: dict[str, type[_Strict]] = {
    "QuantizationModifier": QuantizationModifier,
    "GPTQModifier": GPTQModifier,
    "AWQModifier": AWQModifier,
    "SmoothQuantModifier": SmoothQuantModifier,
}
WEIGHT_MODIFIERS = ("QuantizationModifier", "GPTQModifier", "AWQModifier")


class Recipe(_Strict):
    """The modifiers of every stage, in file order."""

    modifiers: list[tuple[str, _Strict]]
    source: str | None = None  # the YAML text as given
    path: str | None = None

    @property
    def weight_modifier(self) -> _QuantizationFields:
        return next(m for name, m in self.modifiers if name in WEIGHT_MODIFIERS)  # type: ignore[return-value]

    @property
    def method(self) -> str:
        return {"QuantizationModifier": "rtn", "GPTQModifier": "gptq",
                "AWQModifier": "awq"}[self.weight_modifier_name]

    @property
    def weight_modifier_name(self) -> str:
        return next(name for name, _ in self.modifiers if name in WEIGHT_MODIFIERS)

    @property
    def smoothquant(self) -> SmoothQuantModifier | None:
        return next((m for name, m in self.modifiers if name == "SmoothQuantModifier"), None)  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        return {"modifiers": [{name: m.model_dump(mode="json", exclude_defaults=False)}
                              for name, m in self.modifiers]}


# --- error messages that name the key and the keys allowed there ----------------------

def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that owns the last element of ``loc``."""
    current: Any = model
    for part in loc[:-1]:
        current = _step(current, part)
        if current is None:
            return None
    for candidate in _unwrap(current):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _unwrap(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin is None:
        return [annotation]
    return [a for arg in typing.get_args(annotation) for a in _unwrap(arg)] + [annotation]


def _step(current: Any, part: Any) -> Any:
    if isinstance(current, type) and issubclass(current, BaseModel):
        field = current.model_fields.get(part) if isinstance(part, str) else None
        return field.annotation if field else None
    # A container annotation: dict[str, X] / list[X] / X | None; descend into X.
    for candidate in _unwrap(current):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
        origin = typing.get_origin(candidate)
        if origin in (dict, list, tuple):
            args = typing.get_args(candidate)
            inner = args[-1] if origin is dict else args[0]
            for sub in _unwrap(inner):
                if isinstance(sub, type) and issubclass(sub, BaseModel):
                    return sub
    return None


def _describe(exc: ValidationError, model: type[BaseModel], where: str) -> ConfigError:
    # A misspelt key also leaves its correct spelling "missing": report the typo first.
    err = min(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    loc = tuple(err["loc"])
    path = ".".join(str(p) for p in (where, *loc) if p != "")
    if err["type"] == "extra_forbidden":
        owner = _model_at(model, loc)
        allowed = sorted(owner.model_fields) if owner else []
        return ConfigError(f"unknown recipe key {loc[-1]!r} at {path}",
                           f"allowed keys there: {', '.join(allowed)}")
    return ConfigError(f"invalid recipe value at {path}: {err['msg']}",
                       "see recipes/README.md for the fields and their values")


# --- loading ------------------------------------------------------------------------------

def parse_recipe(data: Any, *, source: str | None = None, path: str | None = None) -> Recipe:
    if QuantizationScheme is None:
        raise MissingDependencyError("compressed-tensors is not installed",
                                     "pip install 'llmctl[quant]'")
    if not isinstance(data, dict) or not data:
        raise ConfigError("a recipe is a mapping of stages (`<name>_stage:`)",
                          "see recipes/w4a16-gptq.yaml for the shape")
    modifiers: list[tuple[str, _Strict]] = []
    for stage, groups in data.items():
        if not str(stage).endswith("_stage") or not isinstance(groups, dict):
            raise ConfigError(f"recipe key {stage!r} is not a stage",
                              "top-level keys end in `_stage` and hold `<name>_modifiers:`")
        for group, mods in groups.items():
            if not str(group).endswith("_modifiers") or not isinstance(mods, dict):
                raise ConfigError(f"{stage}.{group} is not a modifier group",
                                  "keys inside a stage end in `_modifiers` and hold modifiers")
            for name, body in mods.items():
                if name not in MODIFIERS:
                    raise ConfigError(f"unknown modifier {name!r} at {stage}.{group}",
                                      f"known modifiers: {', '.join(MODIFIERS)}")
                try:
                    modifiers.append((name, MODIFIERS[name].model_validate(body or {})))
                except ValidationError as exc:
                    raise _describe(exc, MODIFIERS[name], f"{stage}.{group}.{name}") from None
    _check_combination([name for name, _ in modifiers])
    return Recipe(modifiers=modifiers, source=source, path=path)


def _check_combination(names: list[str]) -> None:
    weight = [n for n in names if n in WEIGHT_MODIFIERS]
    if len(weight) != 1:
        raise ConfigError(
            f"a recipe needs exactly one weight modifier, found {len(weight)} ({', '.join(weight) or 'none'})",
            f"use one of {', '.join(WEIGHT_MODIFIERS)} (optionally after a SmoothQuantModifier)")
    if "AWQModifier" in names and "SmoothQuantModifier" in names:
        raise ConfigError("AWQModifier and SmoothQuantModifier both rescale the same channels",
                          "keep one of them")
    if names.count("SmoothQuantModifier") > 1:
        raise ConfigError("more than one SmoothQuantModifier", "keep one")


RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


def find_recipe(path: str | Path) -> Path:
    """A YAML path as given, or a name from the repository's ``recipes/``."""
    file = Path(path).expanduser()
    if file.is_file():
        return file
    builtin = RECIPES_DIR / f"{path}.yaml"
    if builtin.is_file():
        return builtin
    known = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")) if RECIPES_DIR.is_dir() else []
    raise ConfigError(f"no recipe at {path}",
                      "pass a YAML file or one of: " + (", ".join(known) or "none shipped"))


def _read_yaml(file: Path) -> tuple[str, Any]:
    from llmctl.utils.yaml_file import read_yaml

    return read_yaml(file, ConfigError, what="recipe file")


def recipe_format(path: str | Path) -> str:
    """``gguf`` for GGUF recipes (top-level ``format: gguf``), else ``compressed-tensors``."""
    _, data = _read_yaml(find_recipe(path))
    if isinstance(data, dict) and str(data.get("format", "")).lower() == "gguf":
        return "gguf"
    return "compressed-tensors"


def load_recipe(path: str | Path) -> Recipe:
    file = find_recipe(path)
    text, data = _read_yaml(file)
    if isinstance(data, dict) and str(data.get("format", "")).lower() == "gguf":
        raise ConfigError(f"{file} is a GGUF recipe", "pass --format gguf (or let the CLI route it)")
    return parse_recipe(data, source=text, path=str(file))
