"""AWQ (``AWQModifier``): activation-aware scales from a float pass, then
round-to-nearest with AutoAWQ's clipping search.

The float pass keeps every quantized tap's input second moment (rescaled when scales
are folded in); the clipping search reuses it instead of collecting it again.
"""

from __future__ import annotations

import torch

from llmctl.quant import awq
from llmctl.quant.method import ModelLayout, Smoothing, SmoothingJob, WeightJob
from llmctl.quant.methods.rtn import RoundToNearest
from llmctl.quant.recipe import AWQModifier
from llmctl.quant.stats import Needs

# AutoAWQ does not clip q/k: attention logits are sensitive to their range. A fused
# qkv_proj (Phi-3) is left unclipped whole, its v rows with its q and k rows.
UNCLIPPED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.qkv_proj")
# Default pairs llm-compressor's AWQ registry leaves out, by model type: Gemma 3's q/k
# norms make smoothing input_layernorm -> q/k/v worse than round-to-nearest
# (llm-compressor issue #2522, its _gemma3_mappings).
SKIPPED_DEFAULTS: dict[str, tuple[str, ...]] = {"gemma3_text": ("input_layernorm",)}


class AWQ(RoundToNearest):
    needs_data = True
    keeps_hessians = True

    def __init__(self, modifier: AWQModifier) -> None:
        super().__init__(modifier)
        self.modifier: AWQModifier = modifier

    def mappings(self, layout: ModelLayout | None = None) -> list[tuple[str, list[str]]]:
        if self.modifier.mappings is not None:
            return [(m.smooth_layer, m.balance_layers) for m in self.modifier.mappings]
        if layout is None:
            return []
        skipped = SKIPPED_DEFAULTS.get(layout.model_type, ())
        return [(smooth, balance) for smooth, balance in layout.pairs
                if not any(smooth == f"re:.*{name}$" for name in skipped)]

    def smoothing_needs(self, targeted: bool, quantized: bool) -> Needs | None:
        if not (targeted or quantized):
            return None
        return Needs(hessian=True, absmean=targeted)

    def smooth(self, job: SmoothingJob) -> Smoothing:
        moment = job.stats.second_moment
        if job.kinds is None:
            return Smoothing(moment=moment)
        spec = job.plans[0].weight
        if any(p.weight != spec for p in job.plans) or spec.type != "int":
            job.warn(f"layer {job.layer}: AWQ skipped {job.source} (its linears "
                     "differ in scheme or are not integer)")
            return Smoothing(moment=moment)
        block_loss = None
        if self.modifier.objective == "block":
            block_loss = job.block_loss(self.modifier.objective_tokens)
        found = awq.search_scales(job.weights, moment, job.stats.absmean, spec.grid,
                                  n_grid=self.modifier.n_grid,
                                  duo_scaling=self.modifier.duo_scaling,
                                  matmul_dtype=job.compute_dtype, loss_fn=block_loss)
        return Smoothing(found.scales, f"awq alpha={found.alpha:.2f}",
                         awq.scale_hessian(moment, found.scales))

    def weight_needs(self, has_moment: bool) -> Needs:
        # the moment comes from the float pass; lm_head has none and collects it
        return Needs(hessian=not has_moment)

    def int_params(self, job: WeightJob) -> tuple[torch.Tensor, torch.Tensor | None]:
        scale, zero = super().int_params(job)
        if not self.modifier.apply_clip or job.spec.strategy == "tensor":
            return scale, zero
        W = job.W
        clip_scale, clip_zero = awq.clip_search(W, job.stats.second_moment, job.grid,
                                                n_grid=self.modifier.n_grid,
                                                max_shrink=self.modifier.max_shrink)
        keep = torch.cat([torch.full((n,), k in UNCLIPPED)
                          for k, n in zip(job.kinds, job.rows)]).to(W.device).unsqueeze(1)
        scale = torch.where(keep, scale, clip_scale)
        zero = None if zero is None else torch.where(keep, zero, clip_zero)
        return scale, zero

