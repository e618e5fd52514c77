"""PEFT LoRA adapters in the engine's layout, and the table of adapters an engine serves.

A PEFT adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors``
with, per targeted projection ``W`` (``out x in``), ``lora_A`` (``r x in``) and ``lora_B``
(``out x r``); the adapted layer computes (PEFT's ``lora.Linear.forward``)::

    y = W x + s * B (A x),   s = lora_alpha / r   (use_rslora: lora_alpha / sqrt(r))

The engine fuses q/k/v and gate/up into one linear each (:mod:`llmctl.serve.model.weights`),
so an adapter is laid out the same way: per fused linear one ``A`` (the targeted parts'
``A`` stacked: ``sum r x in``) and one block-diagonal ``B`` (``out x sum r``, the rows of
untargeted parts zero), ``s`` folded into ``B``. ``B``'s q and k rows take the engine's
RoPE row order (:func:`llmctl.models.architectures.rope_permute`), as ``W``'s do. Stacking costs
little: ranks are 8-64 against hidden sizes in the hundreds or thousands.

Supported: ``target_modules`` among q/k/v/o/gate/up/down projections (names, or a regex,
or "all-linear": the tensors present decide), ``layers_to_transform``, ``use_rslora``.
Refused with one line: DoRA, ``modules_to_save``, embedding or head targets, trained
biases, ``rank_pattern``/``alpha_pattern``, a rank above ``max_lora_rank``.

Each load gets a fresh ``lora_id``: the prefix cache keys blocks by it (vLLM keys by its
``lora_int_id``), so an adapter unloaded and loaded again under the same name never hits
blocks computed with the old weights.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from llmctl.errors import UsageError

if TYPE_CHECKING:  # torch only where tensors are made: the CLI checks --lora without it
    import torch


class ProjectionShapes(Protocol):
    """What an adapter is checked against: the model's projection shapes (the engine's
    :class:`llmctl.serve.model.decoder.ModelSpec` has them)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    partial_rotary_factor: float


CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# the engine's fused linears and the HF projections in them, in output-row order
FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
PROJECTIONS = {proj: fused for fused, projs in FUSED.items() for proj in projs}
# projections a checkpoint stores fused (Phi-3), so its adapters target them as one
# module: split on read into the projections above (B's rows; A is shared). The split
# keeps the maths: [B_q; B_k; B_v] A x is each B_p A x.
CHECKPOINT_FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# adapter_config.json keys whose non-default values change the maths: refused
_REFUSED = {
    "use_dora": "DoRA adapters (use_dora) are not supported; merge it into the model "
                "(merge_and_unload) or train a plain LoRA",
    "modules_to_save": "adapters with modules_to_save (fully trained extra modules) are "
                       "not supported; merge it into the model (merge_and_unload)",
    "rank_pattern": "per-module ranks (rank_pattern) are not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    "layer_replication": "layer_replication is not supported",
    "target_parameters": "target_parameters is not supported",
    "lora_bias": "adapters with a bias on lora_B (lora_bias) are not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D models) is not supported",
}

_ids = itertools.count(1)


class LoRAError(UsageError):
    """An adapter that cannot be served (bad path, config or tensors): CLI exit 2, HTTP 400."""


class LoRANameError(LoRAError):
    """The adapter's name is the problem (in use, malformed), not its files: the HTTP
    API may say so, where it says only "not a valid adapter" about a path."""


class LoRANotFoundError(UsageError):
    """A request or an unload names an adapter the engine does not hold: HTTP 404."""


def lora_spec(value: str) -> tuple[str, str]:
    """``NAME=PATH`` (``--lora``) -> (name, path)."""
    name, sep, path = value.partition("=")
    name, path = name.strip(), path.strip()
    if not sep or not name or not path:
        raise LoRAError(f"--lora {value!r} is not NAME=PATH",
                        "give the adapter's served name and its PEFT directory, e.g. "
                        "--lora sql=/adapters/sql-lora")
    return name, path


@dataclass(frozen=True)
class AdapterConfig:
    """What the engine reads of ``adapter_config.json``."""

    rank: int
    scaling: float

    @classmethod
    def read(cls, path: Path) -> AdapterConfig:
        file = path / CONFIG_FILE
        try:
            config = json.loads(file.read_text())
        except FileNotFoundError:
            raise LoRAError(f"{path} is not a PEFT adapter: no {CONFIG_FILE}",
                            "pass the directory PEFT's save_pretrained wrote") from None
        except (OSError, ValueError) as exc:
            raise LoRAError(f"cannot read {file}: {exc}", "fix or re-save the adapter") from None
        if not isinstance(config, dict):
            raise LoRAError(f"{file} is not a JSON object", "re-save the adapter with PEFT")
        kind = config.get("peft_type", "LORA")
        if kind != "LORA":
            raise LoRAError(f"{path} is a {kind} adapter; the engine serves LoRA adapters",
                            "train or convert a LoRA adapter")
        for key, why in _REFUSED.items():
            if config.get(key):
                raise LoRAError(f"{path}: {why}", "see `llmctl serve --help` for what runs")
        if config.get("bias", "none") != "none":
            raise LoRAError(f"{path}: adapters that train biases (bias={config['bias']!r}) "
                            "are not supported", "train with bias='none'")
        rank, alpha = config.get("r"), config.get("lora_alpha")
        if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
            raise LoRAError(f"{file}: r={rank!r}, lora_alpha={alpha!r} are not a rank and "
                            "a scale", "re-save the adapter with PEFT")
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        return cls(rank=rank, scaling=float(scale))


@dataclass
class LoRAAdapter:
    """One adapter in the engine's layout: ``layers[i][fused] = (A, B^T)`` with
    ``A: R x in`` and ``B^T: R x out`` (scale folded in), both contiguous, for
    ``(x @ A^T) @ B^T``; a fused linear the adapter does not touch in that layer is
    absent. ``table`` is the native kernels' view of the same tensors, made on first use
    (:mod:`llmctl.serve.lora.batch`)."""

    name: str
    path: str
    rank: int
    scaling: float
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    lora_id: int = field(default_factory=lambda: next(_ids))
    table: object = field(default=None, repr=False, compare=False)

    @property
    def cache_salt(self) -> bytes:
        """Mixed into the first block's hash of its sequences' prefix-cache chains."""
        return b"lora:%d" % self.lora_id

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for layer in self.layers for pair in layer.values() for t in pair)


def _shapes(spec: ProjectionShapes) -> dict[str, tuple[int, int]]:
    """HF projection -> (out, in)."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    h, i = spec.hidden_size, spec.intermediate_size
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    for whole, projs in CHECKPOINT_FUSED.items():
        shapes[whole] = (sum(shapes[p][0] for p in projs), h)
    return shapes


def _split_fused(parts: dict[tuple[int, str], dict[str, torch.Tensor]],
                 shapes: dict[str, tuple[int, int]]) -> None:
    """Replace each fused module's pair by its projections' (``CHECKPOINT_FUSED``)."""
    for (layer, proj) in [k for k in parts if k[1] in CHECKPOINT_FUSED]:
        ab = parts.pop((layer, proj))
        row = 0
        for part in CHECKPOINT_FUSED[proj]:
            rows = shapes[part][0]
            b = ab.get("B")
            parts[(layer, part)] = {"A": ab.get("A"),
                                    "B": None if b is None else b[row:row + rows]}
            row += rows


def load_adapter(name: str, path: str | Path, spec: ProjectionShapes, *, max_rank: int,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu") -> LoRAAdapter:
    """Read, check and lay out a PEFT adapter for a model of ``spec`` (module docstring);
    ``dtype`` None: float32."""
    import torch

    dtype = dtype or torch.float32
    where = Path(path).expanduser()
    config, weights = _locate(name, path, where, max_rank)
    shapes = _shapes(spec)
    parts = _read_parts(name, weights, shapes)
    _check_parts(name, parts, shapes, spec, config.rank)
    _split_fused(parts, shapes)
    layers = [_fuse_layer(parts, i, shapes, spec, config, dtype, device)
              for i in range(spec.num_layers)]
    return LoRAAdapter(name=name, path=str(path), rank=config.rank, scaling=config.scaling,
                       layers=layers)


def _locate(name: str, path: str | Path, where: Path,
            max_rank: int) -> tuple[AdapterConfig, Path]:
    """The adapter's config and weights file, refused before any tensor is read when the
    directory, the rank or the safetensors file is wrong."""
    if not where.is_dir():
        raise LoRAError(f"LoRA adapter {name!r}: {path} is not a directory",
                        "pass the directory PEFT's save_pretrained wrote")
    config = AdapterConfig.read(where)
    if config.rank > max_rank:
        raise LoRAError(f"LoRA adapter {name!r} has rank {config.rank}, above "
                        f"--max-lora-rank {max_rank}",
                        f"raise --max-lora-rank to at least {config.rank}")
    weights = where / WEIGHTS_FILE
    if not weights.is_file():
        raise LoRAError(f"{where} has no {WEIGHTS_FILE}",
                        "re-save the adapter with save_pretrained(safe_serialization=True)")
    return config, weights


def _read_parts(name: str, weights: Path, shapes: dict[str, tuple[int, int]]
                ) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """``(layer, HF projection) -> {"A": ..., "B": ...}`` as the file holds them; a tensor
    for a module the engine cannot adapt is refused."""
    from safetensors import safe_open

    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                match = _KEY.search(key)
                if match is None or match.group(2) not in shapes:
                    raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} targets a module "
                                    "the engine cannot adapt",
                                    "target only q/k/v/o/gate/up/down projections")
                layer, proj, ab = int(match.group(1)), match.group(2), match.group(3)
                parts.setdefault((layer, proj), {})[ab] = handle.get_tensor(key)
    except LoRAError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors' own errors: a damaged file
        raise LoRAError(f"cannot read {weights}: {exc}", "re-save the adapter") from None
    if not parts:
        raise LoRAError(f"LoRA adapter {name!r}: {weights} holds no LoRA tensors",
                        "re-save the adapter with PEFT")
    return parts


def _check_parts(name: str, parts: dict[tuple[int, str], dict[str, torch.Tensor]],
                 shapes: dict[str, tuple[int, int]], spec: ProjectionShapes,
                 rank: int) -> None:
    """Every projection has both ``A`` and ``B`` of this model's shapes, in one of its layers:
    an adapter trained on another base model is refused in one line."""
    for (layer, proj), ab in parts.items():
        out, inp = shapes[proj]
        a, b = ab.get("A"), ab.get("B")
        expected = {"A": (rank, inp), "B": (out, rank)}
        if layer >= spec.num_layers or a is None or b is None \
                or tuple(a.shape) != expected["A"] or tuple(b.shape) != expected["B"]:
            raise LoRAError(
                f"LoRA adapter {name!r} does not fit this model: layer {layer} {proj} has "
                f"A {None if a is None else tuple(a.shape)}, B "
                f"{None if b is None else tuple(b.shape)}; expected {expected['A']}, "
                f"{expected['B']} of {spec.num_layers} layers",
                "serve the adapter with the base model it was trained on")


def _fuse_layer(parts: dict[tuple[int, str], dict[str, torch.Tensor]], i: int,
                shapes: dict[str, tuple[int, int]], spec: ProjectionShapes,
                config: AdapterConfig, dtype: torch.dtype, device: torch.device | str
                ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Layer ``i`` in the engine's layout: per fused linear the stacked ``A`` and the
    block-diagonal, scaled, RoPE-permuted ``B^T`` (module docstring)."""
    import torch

    from llmctl.models.layers.rope import interleave_rows, rotary_dim

    rotated = {"q_proj": spec.num_heads, "k_proj": spec.num_kv_heads}
    dims = rotary_dim(spec.head_dim, spec.partial_rotary_factor)
    fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for target, projs in FUSED.items():
        present = [p for p in projs if (i, p) in parts]
        if not present:
            continue
        r = config.rank
        a = torch.cat([parts[(i, p)]["A"].float() for p in present])
        b = torch.zeros(sum(shapes[p][0] for p in projs), r * len(present))
        row, col = 0, 0
        for p in projs:
            rows = shapes[p][0]
            if p in present:
                part = parts[(i, p)]["B"].float() * config.scaling
                if p in rotated:
                    part = interleave_rows(part, rotated[p], dims)
                b[row:row + rows, col:col + r] = part
                col += r
            row += rows
        fused[target] = (a.to(device=device, dtype=dtype).contiguous(),
                         b.T.to(device=device, dtype=dtype).contiguous())
    return fused


class LoRARegistry:
    """The adapters an engine serves, by name. Loads and unloads may come from any thread
    (the API's); :meth:`get` too. A request holds its adapter object, so unloading one
    that running requests use lets them finish with it (vLLM also unloads lazily); new
    requests naming it get :class:`LoRANotFoundError` at once."""

    def __init__(self, spec: ProjectionShapes, *, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.spec = spec
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self._lock = threading.Lock()
        self._adapters: dict[str, LoRAAdapter] = {}

    def load(self, name: str, path: str | Path) -> LoRAAdapter:
        if not name or name != name.strip():
            raise LoRANameError(f"LoRA name {name!r} is empty or has surrounding spaces",
                            "give the adapter a plain name")
        with self._lock:
            if name in self._adapters:
                raise LoRANameError(f"a LoRA adapter named {name!r} is already loaded",
                                "unload it first, or pick another name")
        adapter = load_adapter(name, path, self.spec, max_rank=self.max_rank,
                               dtype=self.dtype, device=self.device)
        with self._lock:
            if name in self._adapters:  # a concurrent load of the same name won
                raise LoRANameError(f"a LoRA adapter named {name!r} is already loaded",
                                "unload it first, or pick another name")
            self._adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        with self._lock:
            if self._adapters.pop(name, None) is None:
                raise LoRANotFoundError(f"no LoRA adapter named {name!r} is loaded",
                                        f"loaded: {', '.join(self._adapters) or 'none'}")

    def get(self, name: str) -> LoRAAdapter:
        with self._lock:
            adapter = self._adapters.get(name)
            if adapter is None:
                raise LoRANotFoundError(f"no LoRA adapter named {name!r} is loaded",
                                        f"loaded: {', '.join(self._adapters) or 'none'}")
            return adapter

    def names(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._adapters)
