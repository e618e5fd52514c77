"""Write compressed-tensors checkpoints of a float model, and their dequantized twins.

The format is the contract with ``llmctl quantize``: tensors packed with the
``compressed-tensors`` library's own ``pack_to_int32`` and a ``quantization_config``
serialised from its pydantic ``QuantizationConfig``. Weights are rounded to nearest
(the method does not matter here, only the format).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# name -> (num_bits, strategy, group_size, symmetric, format)
SCHEMES = {
    "w4-g32-sym": (4, "group", 32, True, "pack-quantized"),
    "w4-g64-asym": (4, "group", 64, False, "pack-quantized"),
    "w4-channel": (4, "channel", None, True, "pack-quantized"),
    "w8-channel": (8, "channel", None, True, "pack-quantized"),
    "w8-channel-asym": (8, "channel", None, False, "pack-quantized"),
    "w8-g32": (8, "group", 32, True, "pack-quantized"),
    "fp8-channel": (8, "channel", None, True, "float-quantized"),
}


def _quantize_int(w: torch.Tensor, bits: int, group: int, symmetric: bool):
    n, k = w.shape
    g = w.view(n, k // group, group)
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if symmetric:
        scale = g.abs().amax(-1) / qmax
        zp = torch.zeros_like(scale, dtype=torch.int8)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = (hi - lo) / (qmax - qmin)
        zp = (qmin - torch.round(lo / scale)).clamp(qmin, qmax).to(torch.int8)
    scale = scale.clamp(min=1e-8)
    q = (torch.round(g / scale[..., None]) + zp[..., None].float()).clamp(qmin, qmax)
    deq = ((q - zp[..., None].float()) * scale[..., None]).view(n, k)
    return q.to(torch.int8).view(n, k), scale, zp, deq


def write_quantized(src: Path, dst: Path, scheme: str) -> tuple[Path, Path]:
    """``dst`` (compressed) and ``dst-dequant`` (float twin with the same weights)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )
    from safetensors.torch import load_file, save_file

    bits, strategy, group, symmetric, fmt = SCHEMES[scheme]
    weights = load_file(str(src / "model.safetensors"))
    compressed, dequant = {}, {}
    for name, w in weights.items():
        module = name.rsplit(".", 1)[0]
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS):
            compressed[name] = dequant[name] = w
            continue
        w = w.float()
        n, k = w.shape
        if fmt == "float-quantized":
            scale = w.abs().amax(-1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max
            q8 = (w / scale).to(torch.float8_e4m3fn)
            compressed[name] = q8
            compressed[f"{module}.weight_scale"] = scale
            dequant[name] = q8.float() * scale
            continue
        size = group if strategy == "group" else k
        q, scale, zp, deq = _quantize_int(w, bits, size, symmetric)
        compressed[f"{module}.weight_packed"] = pack_to_int32(q, bits)
        compressed[f"{module}.weight_scale"] = scale
        compressed[f"{module}.weight_shape"] = torch.tensor([n, k])
        if not symmetric:
            compressed[f"{module}.weight_zero_point"] = pack_to_int32(zp, bits, packed_dim=0)
        dequant[name] = deq
    args = QuantizationArgs(num_bits=bits, type="float" if fmt == "float-quantized" else "int",
                            symmetric=symmetric, strategy=strategy, group_size=group)
    qconfig = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        format=fmt, quantization_status="compressed", ignore=["lm_head"])
    twin = dst.parent / f"{dst.name}-dequant"
    for out, tensors, qc in ((dst, compressed, qconfig), (twin, dequant, None)):
        shutil.copytree(src, out)
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  str(out / "model.safetensors"), metadata={"format": "pt"})
        if qc is not None:
            config = json.loads((out / "config.json").read_text())
            config["quantization_config"] = json.loads(qc.model_dump_json())
            (out / "config.json").write_text(json.dumps(config, indent=2))
    return dst, twin
