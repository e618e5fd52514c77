"""GGUF recipes: a file type plus per-tensor overrides, as validated data.

A recipe file is YAML with ``format: gguf`` at the top (that is how ``llmctl quantize``
tells it from a compressed-tensors recipe)::

    format: gguf
    type: Q4_K_M                 # the file type (see llmctl.gguf.types)
    output_type: Q8_0            # output.weight (and token_embd when embeddings are tied)
    token_embd_type: Q8_0
    overrides:                   # first matching regex wins, searched in GGUF names
      - {pattern: 'attn_v\\.weight', type: Q6_K}
    imatrix:                     # optional: compute an importance matrix first
      calibration: builtin:pydoc-calib
      samples: 64
      seq_len: 512

Override semantics are llama-quantize's ``--tensor-type``/``--output-tensor-type``/
``--token-embedding-type``: patterns are regular expressions searched in the GGUF
tensor name, and a tensor whose rows do not fit the type's block falls back to a
compatible type (reported in the summary).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from llmctl.errors import ConfigError, LlmctlError
from llmctl.gguf.types import check_tensor_type, file_type
from llmctl.utils.dtypes import DTYPES


def _as_value_error(check, value):
    """pydantic reports ValueErrors with the field's location; ours carry the choices."""
    try:
        return check(value)
    except LlmctlError as exc:
        raise ValueError(f"{exc.message} ({exc.remedy})") from None


class TensorOverride(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pattern: str
    type: str

    @field_validator("pattern")
    @classmethod
    def _regex(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from None
        return value

    @field_validator("type")
    @classmethod
    def _type(cls, value: str) -> str:
        return _as_value_error(check_tensor_type, value)


class ImatrixSpec(BaseModel):
    """Where the importance matrix comes from: a file, or calibration text."""

    model_config = ConfigDict(extra="forbid")

    file: str | None = None  # an existing imatrix (GGUF or legacy .dat)
    calibration: str = "builtin:pydoc-calib"
    field: str = "text"
    samples: int = Field(32, ge=1)
    seq_len: int = Field(512, ge=16)
    seed: int = 0
    save: str | None = None  # also write the computed matrix here (GGUF imatrix format)


class GGUFRecipe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["gguf"] = "gguf"
    description: str | None = None
    type: str = "Q4_K_M"
    output_type: str | None = None
    token_embd_type: str | None = None
    overrides: list[TensorOverride] = Field(default_factory=list)
    # Every quantizable tensor gets ``type``'s tensor type (llama-quantize --pure).
    pure: bool = False
    # The float file llama.cpp quantizes from; "auto" = the checkpoint's own dtype,
    # so nothing is rounded twice.
    intermediate: Literal["auto", "F32", "F16", "BF16"] = "auto"
    # "auto": llmctl writes F32..Q5_1 itself unless an override needs llama.cpp.
    engine: Literal["auto", "llmctl", "llama.cpp"] = "auto"
    imatrix: ImatrixSpec | None = None
    threads: int | None = Field(None, ge=1)

    @field_validator("type")
    @classmethod
    def _file_type(cls, value: str) -> str:
        return _as_value_error(lambda v: file_type(v).name, value)

    @field_validator("output_type", "token_embd_type")
    @classmethod
    def _tensor_type(cls, value: str | None) -> str | None:
        return None if value is None else _as_value_error(check_tensor_type, value)

    def resolved_engine(self) -> str:
        """Which code writes this recipe's file."""
        if self.engine != "auto":
            return self.engine
        own = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"}
        types = {o.type for o in self.overrides} | {self.output_type, self.token_embd_type}
        types.discard(None)
        if file_type(self.type).writer == "llmctl" and types <= own and self.imatrix is None:
            return "llmctl"
        return "llama.cpp"


def is_gguf_recipe(data: dict[str, Any] | str | Path) -> bool:
    """True when a recipe (parsed dict or YAML path) asks for GGUF output."""
    if not isinstance(data, dict):
        data = _read_yaml(Path(data))
    return isinstance(data, dict) and str(data.get("format", "")).lower() == "gguf"


def _read_yaml(path: Path) -> Any:
    from llmctl.utils.yaml_file import read_yaml

    return read_yaml(path, ConfigError, what="recipe file",
                     remedy="pass a path to a YAML recipe (see recipes/)")[1]


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "recipe"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def parse_recipe(data: dict[str, Any] | GGUFRecipe | None, **overrides: Any) -> GGUFRecipe:
    """Validate a recipe dict; keyword ``overrides`` (not None) replace its fields."""
    if isinstance(data, GGUFRecipe):
        data = data.model_dump(exclude_unset=True)
    merged = dict(data or {})
    merged.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return GGUFRecipe.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(f"invalid GGUF recipe: {_validation_message(exc)}",
                          "see recipes/gguf-q4_k_m.yaml for the fields") from None


def load_recipe(path: str | Path, **overrides: Any) -> GGUFRecipe:
    data = _read_yaml(Path(path))
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a mapping", "a recipe is a YAML mapping")
    return parse_recipe(data, **overrides)


def intermediate_type(recipe: GGUFRecipe, source_dtype: str) -> str:
    """The float type of the file handed to llama.cpp."""
    if recipe.intermediate != "auto":
        return recipe.intermediate
    row = DTYPES.get(source_dtype)
    return row.gguf if row and row.gguf else "F32"

