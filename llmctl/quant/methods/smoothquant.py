"""SmoothQuant (``SmoothQuantModifier``): per-channel activation absmax at each mapped
tap, and ``smoothquant.smoothing_scales`` folded in before the weight modifier runs."""

from __future__ import annotations

from llmctl.quant.method import ModelLayout, QuantMethod, Smoothing, SmoothingJob
from llmctl.quant.recipe import SmoothQuantModifier
from llmctl.quant.smoothquant import smoothing_scales
from llmctl.quant.stats import Needs


class SmoothQuant(QuantMethod):
    needs_data = True

    def __init__(self, modifier: SmoothQuantModifier) -> None:
        self.modifier = modifier

    def mappings(self, layout: ModelLayout | None = None) -> list[tuple[str, list[str]]]:
        # llm-compressor writes them (balance layers, smooth layer). Its defaults are the
        # pre-norms' pairs: here the model's own (Gemma 2/3: pre_feedforward_layernorm
        # before the MLP, where llm-compressor's registry names post_attention_layernorm,
        # which sits on attention's output; OLMo 2: none)
        if self.modifier.mappings is not None:
            return [(smooth, balance) for balance, smooth in self.modifier.mappings]
        return [] if layout is None else list(layout.norm_pairs)

    def smoothing_ignore(self) -> list[str]:
        return self.modifier.ignore

    def smoothing_needs(self, targeted: bool, quantized: bool) -> Needs | None:
        return Needs(absmax=True) if targeted else None

    def smooth(self, job: SmoothingJob) -> Smoothing:
        alpha = self.modifier.smoothing_strength
        scales = smoothing_scales(job.stats.absmax, job.weights, alpha)
        return Smoothing(scales, f"smoothquant alpha={alpha:g}")
