"""The contract between a recipe modifier and the layer streamer (``pipeline``).

A quantization method is the hooks of one recipe modifier; the streamer runs a
layer's calibration inputs tap by tap, collects the statistics the methods ask for
and calls the hooks, without knowing any method by name:

1. smoothing (a float pass over the layer, before any weight is quantized):
   ``mappings`` says which taps may be rescaled, ``smoothing_needs`` which statistics
   to collect at a tap, ``smooth`` returns the scales to fold into the weights (and a
   second moment the weight quantizer may reuse);
2. weight quantization (the pass over the already-quantized layer):
   ``weight_needs`` says which statistics a quantized tap needs, ``quantize`` returns
   the codes and scales of the stacked weights of the tap's fused linears.

The defaults do nothing: a method overrides the hooks of the stages it takes part in.
``llmctl.quant.methods`` maps each modifier type to its method.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmctl.quant.fp8 import FP8Grid
from llmctl.quant.plan import ModulePlan, WeightSpec
from llmctl.quant.rtn import IntGrid
from llmctl.quant.stats import Needs, TapStats

# The error of the block's output with these weights for the tap's linears (in the
# tap's kind order): the objective a smoothing search may minimise.
BlockLoss = Callable[[list[torch.Tensor]], float]


@dataclass(frozen=True)
class ModelLayout:
    """The model a method smooths: its ``model_type`` and every (smooth layer, balance
    layers) pair its norm layout can fold (``block.SMOOTHING_SOURCES``): the defaults
    where a recipe names no mappings."""

    model_type: str
    pairs: list[tuple[str, list[str]]]
    norm_pairs: list[tuple[str, list[str]]]  # those whose smooth layer is a norm


@dataclass
class SmoothingJob:
    """One tap of the float pass, its statistics collected."""

    layer: int
    tap: str
    source: str  # the op producing the tap, where scales fold (a norm or a linear)
    kinds: list[str] | None  # the linears to balance; None: the tap is not smoothed
    weights: list[torch.Tensor]  # their float32 weights, as smoothed so far
    plans: list[ModulePlan]
    stats: TapStats
    compute_dtype: torch.dtype  # the calibration activations' dtype
    # the block objective on up to ``tokens`` calibration tokens; None where the tap's
    # block has none (o_proj, down_proj): the linears' own output error is used instead
    block_loss: Callable[[int], BlockLoss | None]
    warn: Callable[[str], None]


@dataclass
class Smoothing:
    scales: torch.Tensor | None = None  # x -> x / s at the source, W -> W diag(s)
    note: str | None = None  # for the report, e.g. "awq alpha=0.35"
    moment: torch.Tensor | None = None  # the smoothed inputs' X^T X / n, for ``quantize``


@dataclass
class WeightJob:
    """The stacked weights of linears that share a tap and a scheme."""

    layer: int  # -1 for lm_head
    kinds: list[str]
    rows: list[int]  # each linear's number of rows in ``W``
    W: torch.Tensor  # float32
    spec: WeightSpec
    grid: IntGrid | FP8Grid
    stats: TapStats | None  # None: a data-free run
    warn: Callable[[str], None]


@dataclass
class WeightResult:
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    loss: float | None = None  # GPTQ's objective, for the report
    dampening: float | None = None


class QuantMethod:
    """Hooks of one recipe modifier; the defaults take part in no stage."""

    # whether the recipe needs calibration data for this modifier
    needs_data: bool = False
    # whether it keeps each quantized tap's X^T X (for the memory estimate)
    keeps_hessians: bool = False
    # whether it quantizes weights (the recipe's one weight modifier)
    quantizes_weights: bool = False

    # --- smoothing -------------------------------------------------------------------

    def mappings(self, layout: ModelLayout | None = None) -> list[tuple[str, list[str]]] | None:
        """(smooth layer, balance layers) patterns for the model ``layout`` describes;
        None: the method does not smooth."""
        return None

    def smoothing_ignore(self) -> list[str]:
        """Patterns of linears whose taps are left unsmoothed."""
        return []

    def smoothing_needs(self, targeted: bool, quantized: bool) -> Needs | None:
        """Statistics of a tap in the float pass; None: the tap is not looked at.
        ``targeted``: a mapping smooths the tap; ``quantized``: a linear it feeds is."""
        return None

    def smooth(self, job: SmoothingJob) -> Smoothing:
        return Smoothing()

    # --- weight quantization -------------------------------------------------------------

    def weight_needs(self, has_moment: bool) -> Needs:
        """Statistics a quantized tap needs; ``has_moment``: smoothing supplied the
        tap's second moment (``TapStats.second_moment`` returns it)."""
        return Needs()

    def quantize(self, job: WeightJob) -> WeightResult:
        raise NotImplementedError(f"{type(self).__name__} does not quantize weights")
