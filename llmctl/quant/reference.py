"""llmctl's own reading of a compressed-tensors checkpoint: a float model that computes
what the quantized model computes.

It decodes the tensors with llmctl's unpacking and dequantization (not the
compressed-tensors library), loads them into a plain transformers model, and emulates
activation quantization with forward pre-hooks. Tests compare its logits with
transformers' own loading of the same directory; ``llmctl eval`` can use it to score
a checkpoint where no quantized kernels exist.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from llmctl.quant import fp8, rtn
from llmctl.quant.packing import unpack_int32
from llmctl.quant.plan import name_matches, resolve_target


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _grid(args: dict[str, Any]) -> rtn.IntGrid:
    size = {"tensor": None, "channel": -1}.get(args["strategy"], args.get("group_size"))
    return rtn.IntGrid(args["num_bits"], args.get("symmetric", True), size)


def decode_weight(prefix: str, tensors: dict[str, torch.Tensor], scheme: dict[str, Any],
                  fmt: str) -> torch.Tensor:
    """The float32 weight of one quantized linear."""
    args = scheme["weights"]
    scale = tensors[f"{prefix}.weight_scale"].float()
    if args["type"] == "float":
        return fp8.dequantize(tensors[f"{prefix}.weight"], scale)
    grid = _grid(args)
    zero = tensors.get(f"{prefix}.weight_zero_point")
    if fmt == "pack-quantized":
        rows, cols = tensors[f"{prefix}.weight_shape"].tolist()
        codes = unpack_int32(tensors[f"{prefix}.weight_packed"], grid.bits, (rows, cols), dim=1)
        if zero is not None and args["strategy"] != "tensor":
            zero = unpack_int32(zero, grid.bits, (rows, scale.shape[1]), dim=0)
    else:
        codes = tensors[f"{prefix}.weight"]
    return rtn.dequantize(codes, scale, zero, grid)


def _activation_hook(args: dict[str, Any], scale: torch.Tensor | None, zero: torch.Tensor | None):
    floating = args["type"] == "float"
    if args.get("dynamic"):
        if args["strategy"] == "token":
            fn = (fp8.fake_quantize_per_token if floating else
                  lambda x: rtn.fake_quantize_per_token(x, args["num_bits"], args.get("symmetric", True)))
        elif floating:
            fn = lambda x: fp8.fake_quantize(x, fp8.scale_for(x.abs().amax()))
        else:
            grid = rtn.IntGrid(args["num_bits"], args.get("symmetric", True), None)
            fn = lambda x: rtn.fake_quantize(x.float(), grid).to(x.dtype)
    elif floating:
        fn = lambda x: fp8.fake_quantize_static(x, scale)
    else:
        fn = lambda x: rtn.fake_quantize_static(x, scale, zero, args["num_bits"])

    def hook(module, inputs):
        return (fn(inputs[0]),) + tuple(inputs[1:])

    return hook


def load_reference(directory: Path, dtype: torch.dtype = torch.float32):
    """A transformers model holding the dequantized weights, with activation hooks."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    raw = json.loads((directory / "config.json").read_text())
    qc = raw.get("quantization_config") or {}
    config = AutoConfig.from_pretrained(str(directory))
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = _tensors(directory)
    groups = {name: _Targets(g["targets"]) for name, g in qc.get("config_groups", {}).items()}
    ignore = qc.get("ignore") or []
    state: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        gname = None if any(name_matches(name, i) or i == "Linear" for i in ignore) \
            else resolve_target(name, "Linear", groups)
        if gname is None:
            continue
        scheme = qc["config_groups"][gname]
        fmt = scheme.get("format") or qc.get("format")
        state[f"{name}.weight"] = decode_weight(name, tensors, scheme, fmt)
        act = scheme.get("input_activations")
        if act:
            module.register_forward_pre_hook(_activation_hook(
                act, tensors.get(f"{name}.input_scale"), tensors.get(f"{name}.input_zero_point")))
    for name, tensor in tensors.items():
        if name not in state and not name.rsplit(".", 1)[-1].startswith(("weight_", "input_")):
            state[name] = tensor
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()},
                                                strict=False)
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"reference load mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if tied:
        model.tie_weights()
    return model.eval()


class _Targets:
    def __init__(self, targets: list[str]) -> None:
        self.targets = targets
