"""The GPTQ column loop against a textbook OBS implementation on a Linear(8, 6)-sized
problem, and invariants that need no reference (identity Hessian == round-to-nearest).

The reference recomputes ``(H_F)^-1`` from scratch for every column in float64 and
applies eq. 3 of the GPTQ paper literally; ``gptq_quantize`` gets the same numbers from
one Cholesky factor and block-wise lazy updates in float32. The problem is chosen so
that no value lands within 1e-3 of a rounding tie (the test checks this), so float32
rounding cannot flip a code and the codes must agree exactly.
"""

import pytest
import torch

from llmctl.quant import fp8, rtn
from llmctl.quant.fp8 import FP8Grid
from llmctl.quant.gptq import gptq_quantize
from llmctl.quant.rtn import IntGrid

ROWS, COLS, DAMP = 6, 8, 0.01


def textbook_gptq(W: torch.Tensor, H: torch.Tensor, bits: int, groups: list[list[int]],
                  order: list[int]):
    """OBS one column at a time (float64), symmetric min/max scales.

    ``groups`` lists the original columns sharing a scale; a group's scale is set when
    its first column comes up (in ``order``), from the group's current values. Returns
    (codes, scale per column, loss, smallest distance of a scaled value to a tie)."""
    W, H = W.double().clone(), H.double()
    Hd = H + DAMP * H.diagonal().mean() * torch.eye(COLS, dtype=torch.float64)
    qmax = (1 << (bits - 1)) - 1
    group_of = {c: k for k, g in enumerate(groups) for c in g}
    scale: dict[int, torch.Tensor] = {}
    codes = torch.zeros(ROWS, COLS, dtype=torch.float64)
    col_scale = torch.zeros(ROWS, COLS, dtype=torch.float64)
    loss, margin = 0.0, float("inf")
    for step, j in enumerate(order):
        k = group_of[j]
        if k not in scale:
            scale[k] = W[:, groups[k]].abs().amax(1) / (qmax + 0.5)
        s = scale[k]
        t = W[:, j] / s
        inside = t.abs() < qmax + 0.5 - 1e-9  # beyond: clamped either way
        to_tie = (t - t.floor() - 0.5).abs()[inside]
        margin = min(margin, float(to_tie.min()) if len(to_tie) else margin)
        q = torch.clamp(torch.round(t), -qmax - 1, qmax)
        codes[:, j], col_scale[:, j] = q, s
        rest = order[step:]  # F: this column and those not yet quantized
        inv = torch.linalg.inv(Hd[rest][:, rest])
        err = (W[:, j] - q * s) / inv[0, 0]
        W[:, rest] -= err[:, None] * inv[0][None, :]
        loss += float((err ** 2).sum() * inv[0, 0] / 2)
    return codes, col_scale, loss, margin


@pytest.fixture(scope="module")
def problem():
    torch.manual_seed(3)
    layer = torch.nn.Linear(COLS, ROWS)
    X = torch.randn(256, COLS) @ (torch.randn(COLS, COLS) * 0.4 + torch.eye(COLS))
    H = 2 * X.t() @ X / X.shape[0]
    # positive weights: every group's largest magnitude is positive, so no value sits at
    # the -(qmax + 1/2) tie of a symmetric grid
    W = layer.weight.detach().abs() + 0.2
    return W, H


def _case(H, actorder, group_size):
    diag_order = torch.argsort(torch.diagonal(H), descending=True).tolist()
    order = diag_order if actorder else list(range(COLS))
    if group_size == -1:
        groups = [list(range(COLS))]  # per channel: one "group" of all columns
    elif actorder == "group":  # consecutive columns of the processing order
        groups = [order[i:i + group_size] for i in range(0, COLS, group_size)]
    else:
        groups = [list(range(i, i + group_size)) for i in range(0, COLS, group_size)]
    return order, groups


@pytest.mark.parametrize("group_size,actorder,block_size", [
    (-1, None, 128), (-1, None, 3), (-1, "static", 128),
    (4, None, 128), (4, None, 4), (2, None, 2),
    (4, "static", 128), (4, "group", 128), (4, "group", 4),
])
def test_matches_textbook_obs(problem, group_size, actorder, block_size):
    W, H = problem
    order, groups = _case(H, actorder, group_size)
    if group_size == -1:  # per-channel scales are fixed from the original weight
        scale = W.double().abs().amax(1) / 7.5
        groups = [list(range(COLS))]
        ref_codes, ref_scale, ref_loss, margin = textbook_gptq(W, H, 4, groups, order)
        assert torch.allclose(ref_scale[:, 0], scale)
    else:
        ref_codes, ref_scale, ref_loss, margin = textbook_gptq(W, H, 4, groups, order)
    assert margin > 1e-3, "test problem too close to a rounding tie: pick another seed"
    res = gptq_quantize(W, H, IntGrid(4, True, group_size), block_size=block_size,
                        dampening=DAMP, actorder=actorder)
    assert torch.equal(res.q.double(), ref_codes)
    assert res.loss == pytest.approx(ref_loss, rel=1e-4)
    if res.g_idx is not None:
        col_scale = res.scale[:, res.g_idx.long()]
    elif group_size == -1:
        col_scale = res.scale.expand(ROWS, COLS)
    else:
        col_scale = res.scale.repeat_interleave(group_size, dim=1)
    assert torch.allclose(col_scale.double(), ref_scale, rtol=1e-5)


@pytest.mark.parametrize("grid", [IntGrid(4, True, 4), IntGrid(4, False, 4), IntGrid(8, True, -1),
                                  IntGrid(4, True, None), FP8Grid(True)])
@pytest.mark.parametrize("actorder", [None, "static"])
def test_identity_hessian_is_round_to_nearest(problem, grid, actorder):
    """With uncorrelated inputs of equal power there is nothing to compensate with."""
    W, _ = problem
    res = gptq_quantize(W, 3.0 * torch.eye(COLS), grid, actorder=actorder)
    if isinstance(grid, FP8Grid):
        codes, _ = fp8.rtn_quantize(W, grid)
        assert torch.equal(res.q.float(), codes.float())
    else:
        codes, scale, _ = rtn.rtn_quantize(W, grid)
        assert torch.equal(res.q, codes) and torch.equal(res.scale, scale)


def test_error_feedback_lowers_output_error(problem):
    """On correlated inputs the compensated weights reproduce W X better than RTN does."""
    W, H = problem
    grid = IntGrid(4, True, 4)
    q, s, z = rtn.rtn_quantize(W, grid)

    def objective(Wq):
        E = (W - Wq).double()
        return float(((E @ H.double()) * E).sum())

    res = gptq_quantize(W, H, grid)
    assert objective(res.dequantize()) < 0.9 * objective(rtn.dequantize(q, s, z, grid))
