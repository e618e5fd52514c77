"""Smoothing inside a mixture of experts: each expert's up_proj -> down_proj, alone.

``act(gate_e(x)) * up_e(x)`` is linear in up_e's output, so ``up_e`` rows divided by ``s``
and ``down_e`` columns multiplied by ``s`` leave expert e's output unchanged, exactly as
the dense MLP's up -> down fold (``block.SMOOTHING_SOURCES``). Each expert's scales come
from its own ``mlp_act`` statistics: the tokens routed to it, or every token under
``calibrate_all_experts`` (``moe_block``). The shared expert folds the same way.

The post-attention norm is never smoothed in a sparse layer (see ``smoothing``): it feeds
the router, which must read the same input and stay bit-identical.

A layer's experts fold where the method folds up -> down in a dense layer of the same
model (AWQ's default mappings do; SmoothQuant's, the pre-norms only, do not), and where
their activation is linear in up (not gpt-oss's clamped SwiGLU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from llmctl.quant import block
from llmctl.quant.method import QuantMethod, SmoothingJob
from llmctl.quant.plan import ModulePlan
from llmctl.quant.smoothing import Smoothed, smoothing_targets
from llmctl.quant.stats import ExpertStats
from llmctl.quant.stream import LayerStream

EXPERT_FOLD = "each expert's up_proj -> down_proj (its own statistics)"


def folds_experts(method: QuantMethod | None, shape: block.BlockShape) -> bool:
    """Whether ``method`` folds up -> down in a dense layer of this model, and the
    experts' activation is linear in up (gpt-oss's clamped SwiGLU, ``(clamp(up) + 1) *
    glu``, is not: its experts are never folded)."""
    moe = shape.moe or next((m for m in shape.layer_moe if m is not None), None)
    if method is None or (moe is not None and moe.expert_act is not None):
        return False
    return "mlp_act" in smoothing_targets(0, method, None, replace(shape, moe=None))


def smooth_experts(i: int, X: torch.Tensor, work: dict[str, torch.Tensor],
                   plans: dict[str, ModulePlan | None], method: QuantMethod,
                   stream: LayerStream, warn: Callable[[str], None], out: Smoothed) -> None:
    """Fold ``method``'s scales into every quantized expert's up/down pair of layer ``i``
    (``work`` changed in place, notes added to ``out``). An expert whose statistics saw
    no token is left as it is (its scales would be 0/0)."""
    shape = stream.shape
    if shape.moe is None or not folds_experts(method, shape):
        return
    groups = [(g, kinds[0]) for g, kinds in shape.groups("mlp_act")
              if plans[kinds[0]] is not None and plans[kinds[0]].quantized]
    needs = method.smoothing_needs(True, True)
    if not groups or needs is None:
        return
    fw = stream.forward_weights(work)
    linear = stream.linear(fw, {})
    stream.inputs("attn_out", X, fw, linear, None, advance=False)  # the attention buffer
    stats = ExpertStats({g: shape.tap_dim("mlp_act", g) for g, _ in shape.groups("mlp_act")},
                        needs, stream.device)
    stream.inputs("mlp_act", X, fw, linear, stats, advance=False)
    ups = {g: kinds[1] for g, kinds in shape.groups("mlp_in")}
    for group, down in groups:
        if stats.groups[group].count == 0:
            continue
        job = SmoothingJob(layer=i, tap="mlp_act", source=ups[group], kinds=[down],
                           weights=[work[f"{down}.weight"]], plans=[plans[down]],
                           stats=stats.groups[group], compute_dtype=stream.cdt,
                           block_loss=lambda tokens: None, warn=warn)
        result = method.smooth(job)
        if result.scales is None:
            continue
        # x -> x / s at up's output rows, W -> W diag(s) in down: the expert is unchanged
        work[f"{ups[group]}.weight"] = work[f"{ups[group]}.weight"] / result.scales.unsqueeze(1)
        work[f"{down}.weight"] = work[f"{down}.weight"] * result.scales.unsqueeze(0)
        out.notes[down] = result.note
