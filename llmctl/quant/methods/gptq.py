"""GPTQ (``GPTQModifier``): each quantized tap's Hessian, collected on the inputs the
already-quantized layers produce, and ``gptq.gptq_quantize`` against it."""

from __future__ import annotations

from llmctl.quant.gptq import gptq_quantize
from llmctl.quant.method import QuantMethod, WeightJob, WeightResult
from llmctl.quant.recipe import GPTQModifier
from llmctl.quant.stats import Needs


class GPTQ(QuantMethod):
    needs_data = True
    keeps_hessians = True
    quantizes_weights = True

    def __init__(self, modifier: GPTQModifier) -> None:
        self.modifier = modifier

    def weight_needs(self, has_moment: bool) -> Needs:
        # from the quantization pass itself, never a smoothing pass's float inputs
        return Needs(hessian=True)

    def quantize(self, job: WeightJob) -> WeightResult:
        res = gptq_quantize(job.W, job.stats.hessian, job.grid, block_size=self.modifier.block_size,
                            dampening=self.modifier.dampening_frac, actorder=job.spec.actorder,
                            observer=job.spec.observer)
        if res.fallback:
            names = ", ".join(f"model.layers.{job.layer}.{k}" for k in job.kinds)
            job.warn(f"GPTQ could not invert the Hessian of {names} even with 100x "
                     f"dampening; used round-to-nearest there (raise dampening_frac in "
                     f"the recipe or add calibration samples)")
        return WeightResult(res.q, res.scale, res.zero, None if res.fallback else res.loss,
                            res.dampening)
