"""The float pass over a layer that smoothing methods (AWQ, SmoothQuant) take part in.

Tap by tap, in the float model, the smoother gets the statistics it asked for and
returns scales; they are folded into the weights (``x -> x / s`` at the tap's source,
``W -> W diag(s)`` in its consumers) before the next tap is run, so later taps see the
smoothed layer. What each tap is smoothed against comes from the method's mappings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from llmctl.errors import ConfigError
from llmctl.quant import block
from llmctl.quant.method import ModelLayout, QuantMethod, SmoothingJob
from llmctl.quant.plan import ModulePlan, name_matches
from llmctl.quant.stats import TapStats
from llmctl.quant.stream import LayerStream


@dataclass
class Smoothed:
    notes: dict[str, str] = field(default_factory=dict)  # linear kind -> report note
    moments: dict[str, torch.Tensor] = field(default_factory=dict)  # tap -> X^T X / n


# A mixture of experts' taps are not smoothed here. The post-attention norm feeds the
# router and every expert's gate/up: folding 1/s into it needs the router's weights
# scaled by s too (llm-compressor's MoE AWQ mappings balance the experts' gate/up only,
# so the router then sees x/s and routes differently; scaling it instead changes the
# router's weights, which must stay bit-identical, and re-rounds them in bf16): that
# norm is left unsmoothed. Each expert's up -> down folds exactly, with its own
# statistics: ``moe_smoothing``.
MOE_UNSMOOTHED = ("mlp_in", "mlp_act")
MOE_NOTE = ("mixture-of-experts layers: nothing folds into the post-attention norm (it "
            "feeds the router too, which stays bit-identical)")


def _moe_tap(shape: block.BlockShape, tap: str) -> bool:
    return shape.moe is not None and tap in MOE_UNSMOOTHED


def model_layout(shape: block.BlockShape) -> ModelLayout:
    """Every (smooth layer, balance layers) pair the layout can fold
    (:data:`block.SMOOTHING_SOURCES`), as mapping patterns: a method's defaults."""
    pairs, norm_pairs = [], []
    for tap in block.TAPS:
        source = None if _moe_tap(shape, tap) else shape.source(tap)
        if source is not None:
            pair = (f"re:.*{source.module}$", [f"re:.*{k}$" for k in shape.linears[tap]])
            pairs.append(pair)
            if source.norm:
                norm_pairs.append(pair)
    return ModelLayout(shape.model_type, pairs, norm_pairs)


def smoothing_targets(i: int, method: QuantMethod, plans: dict[str, ModulePlan | None] | None,
                      shape: block.BlockShape,
                      warn: Callable[[str], None] | None = None) -> dict[str, list[str]]:
    """tap -> balanced linear kinds, from the method's mappings for layer ``i`` (``plans``
    None: whatever is quantized; ``warn`` hears of mappings the layout cannot fold)."""
    prefix = f"model.layers.{i}."
    ignore = method.smoothing_ignore()
    found: dict[str, list[str]] = {}
    sources = {t: None if _moe_tap(shape, t) else shape.source(t) for t in block.TAPS}
    for smooth, balance in method.mappings(model_layout(shape)):
        taps = [t for t, src in sources.items()
                if src is not None and name_matches(prefix + src.module, smooth)]
        if not taps:
            if warn is not None:
                warn(f"smoothing mapping {smooth} -> {', '.join(balance)} folds into nothing "
                     f"in a {shape.model_type} layer ({shape.layout} norms): skipped")
            continue
        tap = taps[0]
        consumers = list(shape.linears[tap])
        kinds = [k for k in consumers if any(name_matches(prefix + k, b) for b in balance)]
        if not kinds:
            continue
        if sorted(kinds) != sorted(consumers):
            raise ConfigError(
                f"smoothing {sources[tap].module} rescales only {', '.join(kinds)}",
                f"the mapping's balance layers must cover every consumer: {', '.join(consumers)}")
        if tap == "attn_out" and shape.kv_heads != shape.heads:
            continue  # v -> o_proj needs matching shapes (not under GQA)
        if plans is not None and any(plans[k] is None or not plans[k].quantized for k in kinds):
            continue  # nothing quantized to protect
        if any(name_matches(prefix + k, ig) for k in kinds for ig in ignore):
            continue
        found[tap] = kinds
    return found


def describe(method: QuantMethod | None, shape: block.BlockShape) -> list[str]:
    """What ``method`` smooths in a layer of this model, one line per folded pair (for
    the dry run), e.g. ``input_layernorm -> self_attn.q_proj, ...``."""
    if method is None:
        return []
    lines = _folds(method, shape)
    if any(s is not None for s in shape.layer_moe):
        if None in shape.layer_moe:  # Qwen-MoE's dense layers (mlp_only_layers) fold more
            sparse = _folds(method, replace(shape, moe=next(s for s in shape.layer_moe if s)))
            lines = sparse + [f"{line} (dense layers)" for line in
                              _folds(method, replace(shape, moe=None)) if line not in sparse]
        lines.append(MOE_NOTE)
    return lines


def _folds(method: QuantMethod, shape: block.BlockShape) -> list[str]:
    lines = []
    for tap, kinds in smoothing_targets(0, method, None, shape).items():
        source = shape.source(tap)
        rows = "" if source.rows is None else f" (rows {source.rows.start}:{source.rows.stop})"
        lines.append(f"{source.module}{rows} -> {', '.join(kinds)}")
    return lines


def smooth_layer(i: int, X: torch.Tensor, work: dict[str, torch.Tensor],
                 plans: dict[str, ModulePlan | None], method: QuantMethod,
                 stream: LayerStream, warn: Callable[[str], None]) -> Smoothed:
    """Choose and fold ``method``'s scales tap by tap (``work`` is changed in place)."""
    shape = stream.shape
    targets = smoothing_targets(i, method, plans, shape, warn if i == 0 else None)
    out = Smoothed()
    needs = {t: None if _moe_tap(shape, t) else method.smoothing_needs(t in targets, any(
        plans[k] is not None and plans[k].quantized for k in shape.linears[t]))
        for t in block.TAPS}
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
            layer=i, tap=tap, source=shape.source(tap).module if kinds else "", kinds=kinds,
            weights=[work[f"{k}.weight"] for k in kinds or []],
            plans=[plans[k] for k in kinds or []], stats=stats, compute_dtype=stream.cdt,
            block_loss=partial(stream.block_loss, tap, kinds, X, fw), warn=warn)
        result = method.smooth(job)
        if result.moment is not None:
            out.moments[tap] = result.moment
        if result.scales is None:
            continue
        fold(work, shape, tap, kinds, result.scales)
        for k in kinds:
            out.notes[k] = result.note
    return out


def fold(work: dict, shape: block.BlockShape, tap: str, kinds: list[str],
         scales: torch.Tensor) -> None:
    """x -> x / s at the source, W -> W diag(s) in the consumers: the float model's
    output does not change. A norm with an offset (Gemma's ``1 + w``) keeps it:
    ``offset + w' = (offset + w) / s``; a fused linear's part divides its own rows."""
    source = shape.source(tap)
    if source.norm:
        off = shape.norm_offset
        work[source.module] = (work[source.module] + off) / scales - off
    else:  # a linear's output rows (and bias)
        rows = source.rows or slice(None)
        weight = work[f"{source.module}.weight"].clone()
        weight[rows] = weight[rows] / scales.unsqueeze(1)
        work[f"{source.module}.weight"] = weight
        if f"{source.module}.bias" in work:
            bias = work[f"{source.module}.bias"].clone()
            bias[rows] = bias[rows] / scales
            work[f"{source.module}.bias"] = bias
    for k in kinds:
        work[f"{k}.weight"] = work[f"{k}.weight"] * scales.unsqueeze(0)
