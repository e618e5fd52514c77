"""The float pass over a layer that smoothing methods (AWQ, SmoothQuant) take part in.

Tap by tap, in the float model, the smoother gets the statistics it asked for and
returns scales; they are folded into the weights (``x -> x / s`` at the tap's source,
``W -> W diag(s)`` in its consumers) before the next tap is run, so later taps see the
smoothed layer. What each tap is smoothed against comes from the method's mappings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from llmctl.errors import ConfigError
from llmctl.quant import block
from llmctl.quant.method import QuantMethod, SmoothingJob
from llmctl.quant.plan import ModulePlan, name_matches
from llmctl.quant.stats import TapStats
from llmctl.quant.stream import TAP_KINDS, LayerStream


@dataclass
class Smoothed:
    notes: dict[str, str] = field(default_factory=dict)  # linear kind -> report note
    moments: dict[str, torch.Tensor] = field(default_factory=dict)  # tap -> X^T X / n


def smoothing_targets(i: int, method: QuantMethod, plans: dict[str, ModulePlan | None],
                      shape: block.BlockShape) -> dict[str, list[str]]:
    """tap -> balanced linear kinds, from the method's mappings for layer ``i``."""
    prefix = f"model.layers.{i}."
    ignore = method.smoothing_ignore()
    found: dict[str, list[str]] = {}
    for smooth, balance in method.mappings():
        taps = [t for t, src in block.TAP_SOURCE.items() if name_matches(prefix + src, smooth)]
        if not taps:
            continue
        tap = taps[0]
        consumers = TAP_KINDS[tap]
        kinds = [k for k in consumers if any(name_matches(prefix + k, b) for b in balance)]
        if not kinds:
            continue
        if sorted(kinds) != sorted(consumers):
            raise ConfigError(
                f"smoothing {block.TAP_SOURCE[tap]} rescales only {', '.join(kinds)}",
                f"the mapping's balance layers must cover every consumer: {', '.join(consumers)}")
        if tap == "attn_out" and shape.kv_heads != shape.heads:
            continue  # v_proj -> o_proj needs matching shapes (not under GQA)
        if any(plans[k] is None or not plans[k].quantized for k in kinds):
            continue  # nothing quantized to protect
        if any(name_matches(prefix + k, ig) for k in kinds for ig in ignore):
            continue
        found[tap] = kinds
    return found


def smooth_layer(i: int, X: torch.Tensor, work: dict[str, torch.Tensor],
                 plans: dict[str, ModulePlan | None], method: QuantMethod,
                 stream: LayerStream, warn: Callable[[str], None]) -> Smoothed:
    """Choose and fold ``method``'s scales tap by tap (``work`` is changed in place)."""
    targets = smoothing_targets(i, method, plans, stream.shape)
    out = Smoothed()
    needs = {t: method.smoothing_needs(t in targets, any(
        plans[k] is not None and plans[k].quantized for k in TAP_KINDS[t])) for t in block.TAPS}
    wanted = [t for t in block.TAPS if needs[t] is not None]
    for tap in block.TAPS[: max((block.TAPS.index(t) for t in wanted), default=-1) + 1]:
        fw = stream.forward_weights(work)
        linear = stream.linear(fw, {})
        stats = None if needs[tap] is None else TapStats(stream.tap_dim(tap), needs[tap],
                                                         stream.device)
        stream.inputs(tap, X, fw, linear, stats, advance=False)
        if stats is None:
            continue
        kinds = targets.get(tap)
        job = SmoothingJob(
            layer=i, tap=tap, source=block.TAP_SOURCE[tap], kinds=kinds,
            weights=[work[f"{k}.weight"] for k in kinds or []],
            plans=[plans[k] for k in kinds or []], stats=stats, compute_dtype=stream.cdt,
            block_loss=partial(stream.block_loss, tap, kinds, X, fw), warn=warn)
        result = method.smooth(job)
        if result.moment is not None:
            out.moments[tap] = result.moment
        if result.scales is None:
            continue
        fold(work, tap, kinds, result.scales)
        for k in kinds:
            out.notes[k] = result.note
    return out


def fold(work: dict, tap: str, kinds: list[str], scales: torch.Tensor) -> None:
    """x -> x / s at the source, W -> W diag(s) in the consumers: the float model's
    output does not change."""
    source = block.TAP_SOURCE[tap]
    if source in work:  # a norm's weight
        work[source] = work[source] / scales
    else:  # a linear's output rows (and bias)
        work[f"{source}.weight"] = work[f"{source}.weight"] / scales.unsqueeze(1)
        if f"{source}.bias" in work:
            work[f"{source}.bias"] = work[f"{source}.bias"] / scales
    for k in kinds:
        work[f"{k}.weight"] = work[f"{k}.weight"] * scales.unsqueeze(0)
