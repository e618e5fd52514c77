"""What a planned scheme means numerically: a weight spec's grid and dequantization,
and the inference-time activation quantization that calibration emulates.

These depend on the scheme (``plan.WeightSpec`` / ``plan.ActSpec``) only, never on the
method that chose the weights, so every method and the layer streamer share them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmctl.quant import fp8, rtn
from llmctl.quant.fp8 import FP8Grid
from llmctl.quant.plan import ActSpec, WeightSpec
from llmctl.quant.rtn import IntGrid
from llmctl.quant.stats import TapStats


def weight_grid(spec: WeightSpec) -> IntGrid | FP8Grid:
    return FP8Grid(spec.strategy == "channel") if spec.type == "float" else spec.grid


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
               spec: WeightSpec) -> torch.Tensor:
    if spec.type == "float":
        return fp8.dequantize(codes, scale)
    return rtn.dequantize(codes, scale, zero, spec.grid)


def act_quantizer(act: ActSpec | None, stats: TapStats | None
                  ) -> tuple[Callable | None, torch.Tensor | None, torch.Tensor | None]:
    """(callable applying the inference-time activation quantization, scale, zero)."""
    if act is None:
        return None, None, None
    if act.dynamic:
        if act.type == "float":
            fn = fp8.fake_quantize_per_token if act.strategy == "token" else (
                lambda x: fp8.fake_quantize(x, fp8.scale_for(x.abs().amax())))
        elif act.strategy == "token":
            fn = lambda x: rtn.fake_quantize_per_token(x, act.bits, act.symmetric)
        else:
            grid = rtn.IntGrid(act.bits, act.symmetric, None)
            fn = lambda x: rtn.fake_quantize(x.float(), grid).to(x.dtype)
        return fn, None, None
    if act.type == "float":
        scale = fp8.scale_for(torch.maximum(-stats.lo, stats.hi)).reshape(1)
        return (lambda x: fp8.fake_quantize_static(x, scale)), scale, None
    scale, zero = rtn.params_from_range(stats.lo, stats.hi, rtn.IntGrid(act.bits, act.symmetric))
    scale, zero = scale.reshape(1), None if zero is None else zero.reshape(1)
    return (lambda x: rtn.fake_quantize_static(x, scale, zero, act.bits)), scale, zero
