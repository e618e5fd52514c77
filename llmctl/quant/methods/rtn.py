"""Round-to-nearest weights (``QuantizationModifier``): from the weights alone.

Integer grids take their scales from the observer (minmax or mse); FP8 (E4M3) from the
weight's absmax per tensor or channel. No statistics, no smoothing: with dynamic (or
no) activation quantization and no KV-cache scales the run reads no data.
"""

from __future__ import annotations

import torch

from llmctl.quant import fp8, rtn
from llmctl.quant.method import QuantMethod, WeightJob, WeightResult
from llmctl.quant.recipe import QuantizationModifier


class RoundToNearest(QuantMethod):
    quantizes_weights = True

    def __init__(self, modifier: QuantizationModifier) -> None:
        self.modifier = modifier

    def quantize(self, job: WeightJob) -> WeightResult:
        if job.spec.type == "float":
            codes, scale = fp8.rtn_quantize(job.W, job.grid)
            return WeightResult(codes, scale)
        scale, zero = self.int_params(job)
        return WeightResult(rtn.quantize(job.W, scale, zero, job.grid), scale, zero)

    def int_params(self, job: WeightJob) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale, zero) of an integer grid; a subclass may search them instead."""
        return rtn.observe(job.W, job.grid, job.spec.observer)
