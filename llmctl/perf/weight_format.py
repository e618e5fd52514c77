"""How a model's weights are stored, in bits per weight, scales and zero points included.

A quantized linear stores, per weight, ``bits`` of code; per group of ``group_size``
weights along the input features (or per output row for per-channel scales, per block for
block scales), one scale of ``scale_bits`` and, when asymmetric, one zero point. Zero
points are packed at the codes' width: compressed-tensors' ``pack-quantized`` packs int4
zeros into int32 words as it does the codes (its 8-bit format stores int8 zeros), and
AutoGPTQ/AutoAWQ pack ``qzeros`` the same way. So::

    bits/weight = bits + (scale_bits + (bits if asymmetric else 0)) / group

    int4 g128, bf16 scale, symmetric:   4 + 16/128     = 4.125
    int4 g128, bf16 scale, asymmetric:  4 + (16+4)/128 = 4.156

Scales are counted at 16 bits (the serving dtype: vLLM's kernels take bf16/fp16 scales,
and llm-compressor writes them in the model's dtype); GPTQ's act-order ``g_idx`` (one
int32 per input column of a layer, < 0.01 bit per weight) is left out.

What ``targets`` and ``ignore`` select is quantized, matched the way compressed-tensors
matches it: an exact module name, a ``re:`` regex, or the class name ``Linear``. The
embedding is never a Linear and keeps ``base_bits``; so do norms and ignored layers
(``lm_head`` by default, as llm-compressor's presets leave it).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from llmctl.errors import ConfigError


@dataclass(frozen=True)
class WeightFormat:
    name: str
    bits: int  # code bits of a quantized linear; unquantized: base_bits
    quantized: bool
    compute_dtype: str  # the :data:`llmctl.perf.peaks.DTYPES` key matrix products run in
    granularity: str = "channel"  # of the scales: "tensor" | "channel" | "group" | "block"
    group_size: int | None = None  # weights per scale for "group" / "block"
    symmetric: bool = True
    scale_bits: int = 16
    base_bits: int = 16  # embedding, norms and layers left unquantized
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ("lm_head",)

    def __post_init__(self) -> None:
        if self.granularity not in ("tensor", "channel", "group", "block"):
            raise ConfigError(f"unknown scale granularity {self.granularity!r}",
                              "use tensor, channel, group or block")
        if self.granularity in ("group", "block") and not (self.group_size or 0) > 0:
            raise ConfigError(f"{self.name}: a {self.granularity} scale needs a positive size",
                              "give the group size, e.g. w4a16-g128")

    # --- construction ---------------------------------------------------------------------
    @classmethod
    def from_name(cls, name: str) -> WeightFormat:
        """``fp32 | bf16 | fp16 | fp8 | int8 | w8a16 | w4a16``; the weight-only integer
        formats take a group suffix (``w4a16-g64``; w4a16 defaults to group 128)."""
        text = name.strip().lower()
        base, _, suffix = text.partition("-g")
        entry = NAMED.get(base)
        if entry is None:
            raise ConfigError(f"unknown weight format {name!r}",
                              "known: " + ", ".join(NAMED) + " (w4a16/w8a16 take -gN, e.g. "
                              "w4a16-g64)")
        if not suffix:
            return entry
        if base not in ("w4a16", "w8a16") or not suffix.isdigit() or int(suffix) < 1:
            raise ConfigError(f"bad group suffix in {name!r}",
                              "only w4a16/w8a16 take one: w4a16-g32, w4a16-g64, w4a16-g128")
        return replace(entry, name=f"{base}-g{int(suffix)}", granularity="group",
                       group_size=int(suffix))

    @classmethod
    def from_quant_config(cls, qc: dict[str, Any], base_bits: int = 16) -> WeightFormat:
        """From a config.json ``quantization_config``: compressed-tensors (what ``llmctl
        quantize`` and llm-compressor write), AutoGPTQ, AutoAWQ or block FP8."""
        method = str(qc.get("quant_method", "compressed-tensors"))
        reader = _READERS.get(method)
        if reader is None:
            raise ConfigError(f"quantization_config quant_method {method!r} is not modelled",
                              "known: " + ", ".join(_READERS) + "; or pass --weights")
        return reader(qc, base_bits)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> WeightFormat:
        """The format a config.json describes: its quantization_config, else 16-bit (a
        float32 checkpoint is served in bf16, as vLLM's ``dtype=auto`` does)."""
        qc = cfg.get("quantization_config")
        if qc:
            return cls.from_quant_config(qc)
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        return NAMED["fp16" if dtype == "float16" else "bf16"]

    # --- what it costs ----------------------------------------------------------------------
    @functools.cached_property
    def _ignore(self) -> tuple:
        return tuple(_matcher(t) for t in self.ignore)

    @functools.cached_property
    def _targets(self) -> tuple:
        return tuple(_matcher(t) for t in self.targets if t != "Linear")

    def quantizes(self, module: str) -> bool:
        """Whether the linear layer named ``module`` (``model.layers.3.mlp.up_proj``,
        ``lm_head``) is stored quantized."""
        if not self.quantized or any(m(module) for m in self._ignore):
            return False
        return "Linear" in self.targets or any(m(module) for m in self._targets)

    def bits_per_weight(self, in_features: int | None = None, out_features: int = 1) -> float:
        """Bits one weight of a quantized linear costs, its share of scales (and zero
        points) included. Per-channel and per-tensor scales depend on the layer's shape."""
        if not self.quantized:
            return float(self.base_bits)
        per_scale = self.scale_bits + (0 if self.symmetric else self.bits)
        if self.granularity in ("group", "block"):
            # a row of ``in_features`` holds ceil(in / group) groups (the last may be short)
            if self.granularity == "group" and in_features:
                return self.bits + math.ceil(in_features / self.group_size) * per_scale / in_features
            return self.bits + per_scale / self.group_size
        if in_features is None:
            raise ValueError(f"{self.name}: per-{self.granularity} scales need the layer shape")
        weights_per_scale = in_features * (out_features if self.granularity == "tensor" else 1)
        return self.bits + per_scale / weights_per_scale

    def linear_bits(self, module: str, out_features: int, in_features: int) -> float:
        """Bits per weight of the linear ``module`` of this shape, quantized or not."""
        if self.quantizes(module):
            return self.bits_per_weight(in_features, out_features)
        return float(self.base_bits)

    def describe(self) -> str:
        if not self.quantized:
            return f"{self.name} ({self.base_bits}-bit)"
        where = {"group": f"group {self.group_size}", "block": f"block of {self.group_size}",
                 "channel": "per channel", "tensor": "per tensor"}[self.granularity]
        sym = "symmetric" if self.symmetric else "asymmetric"
        kept = f"; {', '.join(self.ignore)} kept at {self.base_bits}-bit" if self.ignore else ""
        return (f"{self.name}: {self.bits}-bit codes, {self.scale_bits}-bit scales {where}, "
                f"{sym}; products in {self.compute_dtype}{kept}")


def _matcher(target: str):
    if target.startswith("re:"):
        pattern = re.compile(target[3:])
        return lambda name: pattern.match(name) is not None
    return lambda name: name == target


def _unquantized(name: str, bits: int, dtype: str) -> WeightFormat:
    return WeightFormat(name, bits, False, dtype, base_bits=bits, ignore=())


NAMED: dict[str, WeightFormat] = {
    "fp32": _unquantized("fp32", 32, "fp32"),
    "bf16": _unquantized("bf16", 16, "bf16"),
    "fp16": _unquantized("fp16", 16, "fp16"),
    # W8A8: 8-bit weights with per-channel scales, activations quantized per token at run
    # time, products in fp8 / int8 (llm-compressor's FP8_DYNAMIC and W8A8 presets)
    "fp8": WeightFormat("fp8", 8, True, "fp8"),
    "int8": WeightFormat("int8", 8, True, "int8"),
    # weight-only: int codes dequantized to bf16 in the kernel (Marlin, Machete)
    "w8a16": WeightFormat("w8a16", 8, True, "bf16"),
    "w4a16": WeightFormat("w4a16", 4, True, "bf16", "group", 128),
}


def _label(bits: int, kind: str, act: str | None, granularity: str, group: int | None,
           symmetric: bool) -> str:
    """A name in the style of :data:`NAMED`: fp8, int8, w4a16-g128, w4a8, ..."""
    if act is None:
        name = f"w{bits}a16" if kind == "int" else f"fp{bits}-w{bits}a16"
    elif kind == "float":
        name = f"fp{bits}"
    else:
        name = "int8" if bits == 8 else f"w{bits}a8"
    if granularity == "group":
        name += f"-g{group}"
    return name if symmetric else name + "-asym"


def _compressed_tensors(qc: dict[str, Any], base_bits: int) -> WeightFormat:
    groups = qc.get("config_groups") or {}
    schemes = {}
    targets: list[str] = []
    for gname, scheme in groups.items():
        weights = (scheme or {}).get("weights")
        if not weights:
            raise ConfigError(f"quantization_config group {gname!r} quantizes no weights",
                              "activation-only schemes are not modelled; pass --weights")
        acts = scheme.get("input_activations") or None
        if acts is not None and int(acts.get("num_bits", 8)) != 8:
            raise ConfigError(f"quantization_config group {gname!r} has "
                              f"{acts.get('num_bits')}-bit activations",
                              "only 8-bit (fp8/int8) or 16-bit activations are modelled")
        key = (int(weights["num_bits"]), str(weights.get("type", "int")),
               str(weights.get("strategy") or "tensor"), weights.get("group_size"),
               bool(weights.get("symmetric", True)),
               None if acts is None else str(acts.get("type", "int")))
        schemes[gname] = key
        targets.extend(scheme.get("targets") or ["Linear"])
    if not schemes:
        raise ConfigError("quantization_config has no config_groups", "pass --weights")
    if len(set(schemes.values())) > 1:
        listed = "; ".join(f"{g}: {k[1]}{k[0]} {k[2]}" for g, k in schemes.items())
        raise ConfigError(f"quantization_config mixes schemes ({listed})",
                          "mixed schemes are not modelled; pass --weights for the dominant one")
    bits, kind, strategy, group, symmetric, act = next(iter(schemes.values()))
    if strategy not in ("tensor", "channel", "group", "block", "tensor_group"):
        raise ConfigError(f"quantization_config weight strategy {strategy!r} is not modelled",
                          "pass --weights")
    granularity = "group" if strategy == "tensor_group" else strategy
    if granularity == "block":
        block = groups[next(iter(groups))]["weights"].get("block_structure") or [128, 128]
        group = int(block[0]) * int(block[1])
    compute = {"float": "fp8", "int": "int8"}.get(act or "", "bf16")
    return WeightFormat(_label(bits, kind, act, granularity, group, symmetric), bits, True,
                        compute, granularity, group if granularity in ("group", "block") else None,
                        symmetric, 16, base_bits, tuple(dict.fromkeys(targets)),
                        tuple(qc.get("ignore") or ()))


def _gptq_awq(qc: dict[str, Any], base_bits: int) -> WeightFormat:
    awq = qc.get("quant_method") == "awq"
    bits = int(qc.get("bits") or qc.get("w_bit") or 4)
    group = int(qc.get("group_size") or qc.get("q_group_size") or -1)
    # AutoAWQ stores zero points (zero_point: true) by default; AutoGPTQ says sym
    symmetric = not qc.get("zero_point", True) if awq else bool(qc.get("sym", True))
    granularity = "channel" if group == -1 else "group"
    ignore = () if qc.get("lm_head") else ("lm_head",)
    return WeightFormat(_label(bits, "int", None, granularity, group, symmetric), bits, True,
                        "bf16", granularity, group if group > 0 else None, symmetric, 16,
                        base_bits, ("Linear",),
                        ignore + tuple(qc.get("modules_to_not_convert") or ()))


def _fp8(qc: dict[str, Any], base_bits: int) -> WeightFormat:
    block = qc.get("weight_block_size")
    ignore = ("lm_head", *(qc.get("modules_to_not_convert") or ()))
    if block:  # DeepSeek-style: one float32 scale per block
        return WeightFormat("fp8-block", 8, True, "fp8", "block", int(block[0]) * int(block[1]),
                            scale_bits=32, base_bits=base_bits, ignore=tuple(dict.fromkeys(ignore)))
    return replace(NAMED["fp8"], granularity="tensor", scale_bits=32, base_bits=base_bits,
                   ignore=tuple(dict.fromkeys(ignore)))


_READERS = {"compressed-tensors": _compressed_tensors, "gptq": _gptq_awq, "awq": _gptq_awq,
            "fp8": _fp8}

