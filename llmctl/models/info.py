"""What ``llmctl info`` reports about a checkpoint, read without loading weights: the
config's shape, the weights' parameter count and dtype (safetensors headers), the
tokenizer, and the family's features worth knowing before running it (:func:`features`:
norm layout, activation, attention scale and soft-caps, the sliding-window pattern, RoPE).
Sizes from the config alone (parameters, KV bytes) are :mod:`llmctl.perf.footprint`'s.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmctl.errors import UnsupportedArchitectureError
from llmctl.models.spec import FAMILIES, ModelArch
from llmctl.utils.dtypes import SAFETENSORS

# Tensors that hold quantization parameters rather than model parameters.
_AUX_SUFFIXES = ("_scale", "_zero_point", "_g_idx", "weight_shape", "input_global_scale",
                 "weight_global_scale")


@dataclass
class ModelInfo:
    path: str
    source: str
    model_type: str
    architecture: str
    parameters: int
    layers: int
    hidden_size: int
    intermediate_size: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rope_theta: float | None
    tied_embeddings: bool
    dtype: str
    size_on_disk: int
    tokenizer: str | None
    chat_template: bool
    eos_token: str | None
    quantization: dict[str, Any] | None
    features: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length))


def _count_parameters(directory: Path, quant: dict | None) -> tuple[int, str]:
    """Logical parameter count (packed low-bit weights unpacked) and the main dtype."""
    total = 0
    dtypes: dict[str, int] = {}
    for file in sorted(directory.glob("*.safetensors")):
        for name, entry in safetensors_header(file).items():
            if name == "__metadata__" or name.endswith(_AUX_SUFFIXES):
                continue
            numel = 1
            for dim in entry["shape"]:
                numel *= dim
            if name.endswith("weight_packed"):
                # compressed-tensors packs 32 // num_bits values per int32.
                numel = numel * SAFETENSORS[entry["dtype"]].bits // _packed_bits(quant)
            total += numel
            dtypes[entry["dtype"]] = dtypes.get(entry["dtype"], 0) + numel
    main = max(dtypes, key=dtypes.get) if dtypes else "unknown"
    return total, main


def _packed_bits(quant: dict | None) -> int:
    for group in (quant or {}).get("config_groups", {}).values():
        bits = (group.get("weights") or {}).get("num_bits")
        if bits:
            return int(bits)
    return 4


def _tokenizer_summary(directory: Path) -> tuple[str | None, bool, str | None]:
    config_path = directory / "tokenizer_config.json"
    if not config_path.is_file():
        return None, False, None
    config = json.loads(config_path.read_text())
    template = bool(config.get("chat_template")) or (directory / "chat_template.jinja").is_file()
    eos = config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    return config.get("tokenizer_class"), template, eos


def window_pattern(windows: tuple[int | None, ...]) -> str | None:
    """One letter per layer, ``S`` sliding-window and ``F`` full attention (None: no layer
    has a window)."""
    if not any(windows):
        return None
    return "".join("S" if w else "F" for w in windows)


def _rope(params: dict | None) -> dict[str, Any] | None:
    if params is None:
        return None
    return {"type": params["rope_type"], "theta": params.get("rope_theta"),
            **{k: params[k] for k in ("factor", "original_max_position_embeddings")
               if k in params}}


def features(arch: ModelArch) -> dict[str, Any]:
    """The family's computation as its row and config.json state it (``None``: off)."""
    fam = arch.family
    windows = sorted({w for w in arch.layer_windows if w})
    scale = arch.attention_scale
    return {
        "norms": fam.norms, "norm_offset": fam.norm_offset,
        "qk_norm": fam.qk_norm_over if arch.qk_norm else None,
        "activation": arch.hidden_act,
        "attention_scale": None if abs(scale - arch.head_dim ** -0.5) < 1e-12 else scale,
        "attn_softcap": arch.attn_softcap, "final_softcap": arch.final_softcap,
        "sliding_windows": windows or None,
        "window_pattern": window_pattern(arch.layer_windows),
        "rope": _rope(arch.rope), "local_rope": _rope(arch.local_rope),
        "partial_rotary_factor": arch.partial_rotary_factor,
        "embedding_multiplier": arch.embedding_multiplier,
        "residual_multiplier": arch.residual_multiplier,
        "logits_scaling": arch.logits_scaling,
        "fused_projections": list(fam.fused) or None,
    }


def _arch(config: dict[str, Any]) -> ModelArch:
    """The architecture of a type in the family table; another type is refused."""
    model_type = config.get("model_type") or (config.get("text_config") or {}).get(
        "model_type")
    if model_type and model_type not in FAMILIES:
        raise UnsupportedArchitectureError(
            f"model type {model_type!r} is not supported",
            f"llmctl knows {', '.join(sorted(FAMILIES))}; adding a family: "
            "docs/architecture.md, 'Where to add'")
    return ModelArch.from_config(config)


def model_info(directory: Path, source: str = "local") -> ModelInfo:
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    arch = _arch(config)
    quant = config.get("quantization_config")
    params, dtype = _count_parameters(directory, quant)
    tokenizer, template, eos = _tokenizer_summary(directory)
    return ModelInfo(
        path=str(directory),
        source=source,
        model_type=config.get("model_type", "?"),
        architecture=(config.get("architectures") or ["?"])[0],
        parameters=params,
        layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        heads=arch.num_heads,
        kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        vocab_size=arch.vocab_size,
        context_length=arch.max_position_embeddings or 0,
        rope_theta=arch.rope_theta,
        tied_embeddings=arch.tie_word_embeddings,
        dtype=dtype,
        size_on_disk=sum(p.stat().st_size for p in directory.iterdir() if p.is_file()),
        tokenizer=tokenizer,
        chat_template=template,
        eos_token=eos,
        quantization=quant,
        features=features(arch),
    )
