"""GPTQ (Frantar et al. 2022, arXiv:2210.17323): quantize a weight column by column and
push each column's rounding error onto the columns not yet quantized.

Tensors in, tensors out: ``gptq_quantize(W, H, grid)``. The Hessian comes from
``hessian.HessianAccumulator``; walking the model layer by layer is ``pipeline``'s job.

The maths. For a linear layer with inputs X (tokens x cols) the loss of a quantized W'
is ``||(W - W') X^T||^2 = tr((W - W') H (W - W')^T) / 2`` with ``H = 2 X^T X``; every
row of W is an independent problem sharing H. Quantizing column j and compensating
optimally with the columns F not yet quantized gives (OBS, eq. 2-3):

    err_j   = (w_j - q_j) / [H_F^-1]_jj
    w_F    -= err_j * (H_F^-1)_{j,F}          loss += err_j^2 [H_F^-1]_jj / 2

Section 3.3: in a fixed column order, the rows ``(H_F^-1)_{j,F} / sqrt([H_F^-1]_jj)`` are
the rows of the upper Cholesky factor U of ``H^-1`` (``H^-1 = U^T U``), so with
``d_j = U_jj`` the update is ``err_j = (w_j - q_j) / d_j``, ``w_F -= err_j U_{j,F}``,
``loss += err_j^2 / 2``. Section 3.2 ("lazy batch updates"): the updates are applied
eagerly inside a block of B columns and to the columns after the block once, as one
matmul ``W_after -= Err_block U_{block,after}``. Section 5 ("percdamp"): dampening adds
``percdamp * mean(diag H)`` to the diagonal so that the inverse exists.

Activation ordering ("act-order") processes columns by decreasing ``diag(H)`` (most
active inputs first, while many columns are left to absorb their error):

- ``static`` (compressed-tensors "weight"): groups stay contiguous in the stored layout,
  no extra tensor;
- ``group``: groups are formed in processing order, which needs a ``g_idx`` (column ->
  group) at inference time.

Group scales are found when a group's first column comes up, from the group's
error-compensated values at that moment (scales fixed from the original weights clip
the compensation, worse for small groups); FP8, per-tensor and per-channel scales are
fixed up front from the original weight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmctl.quant import fp8, rtn
from llmctl.quant.fp8 import FP8Grid
from llmctl.quant.rtn import IntGrid

ACTORDERS = (None, "static", "weight", "group", "dynamic")
ACTORDER_ALIASES = {"weight": "static", "dynamic": "group"}  # compressed-tensors names


@dataclass
class GPTQResult:
    q: torch.Tensor  # int8 codes (float8_e4m3fn for FP8), original column order
    scale: torch.Tensor
    zero: torch.Tensor | None
    g_idx: torch.Tensor | None  # only for act-order "group"
    loss: float  # the GPTQ objective's increase, sum over rows
    dampening: float | None  # the dampening fraction that worked; None after a fallback
    fallback: bool = False  # True: the Hessian could not be inverted, RTN was used
    group_size: int | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.q.dtype == torch.float8_e4m3fn:
            return fp8.dequantize(self.q, self.scale, dtype)
        return dequantize(self.q, self.scale, self.zero, self.g_idx, self.group_size, dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
               g_idx: torch.Tensor | None, group_size: int | None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    grid = IntGrid(8, zero is None, group_size)
    if g_idx is None:
        return rtn.dequantize(q, scale, zero, grid, dtype)
    cols = g_idx.long()
    w = q.float()
    if zero is not None:
        w = w - zero.float()[:, cols]
    return (w * scale.float()[:, cols]).to(dtype)


def inverse_hessian_cholesky(H: torch.Tensor, dampening: float,
                             boosts: tuple[float, ...] = (1.0, 10.0, 100.0)
                             ) -> tuple[torch.Tensor | None, float | None]:
    """Upper Cholesky factor U of ``(H + damp*I)^-1`` (``U^T U``), and the dampening
    fraction used: raised 10x, then 100x when the factorisation fails.

    Without forming the inverse: with J the exchange matrix (reversing the order) and
    ``J H J = L L^T``, ``U = J L^-1 J`` is upper triangular with a positive diagonal and
    ``U^T U = J (L L^T)^-1 J = H^-1``, so it is that Cholesky factor. One Cholesky and one
    triangular inverse (n^3/3 multiply-adds each) instead of Cholesky, inverse and
    Cholesky again (twice the work); as accurate against float64 (measured)."""
    mean_diag = torch.diagonal(H).mean()
    damped = H.flip(0, 1)  # J H J (a copy: dampened in place below)
    undamped = damped.diagonal().clone()
    for boost in boosts:
        frac = dampening * boost
        damped.diagonal().copy_(undamped + frac * mean_diag)
        lower, info = torch.linalg.cholesky_ex(damped)
        if info.item() != 0:
            continue
        upper = lower_triangular_inverse(lower).flip(0, 1)
        # (a sum is finite iff every entry is: one reduction instead of a mask)
        if torch.isfinite(upper.sum()):
            return upper, frac
    return None, None


def lower_triangular_inverse(L: torch.Tensor, base: int = 96) -> torch.Tensor:
    """``L^-1`` for lower-triangular L, by halves:
    ``[[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1, D^-1]]`` (matmuls do the work;
    a triangular solve against the identity would cost n^3 instead of n^3/3)."""
    n = L.shape[0]
    if n <= base:
        return torch.linalg.solve_triangular(L, torch.eye(n, dtype=L.dtype, device=L.device),
                                             upper=False)
    h = n // 2
    inv_a, inv_d = lower_triangular_inverse(L[:h, :h], base), lower_triangular_inverse(L[h:, h:], base)
    out = torch.zeros_like(L)
    out[:h, :h] = inv_a
    out[h:, h:] = inv_d
    out[h:, :h] = -(inv_d @ (L[h:, :h] @ inv_a))
    return out


class single_thread:
    """Run GPTQ on one thread: the column loop's ops are tiny, and a thread pool's
    synchronisation costs more than it saves (badly so on a busy machine: measured
    0.3 s on one thread vs 4-9 s on two for a 960 x 576 weight on a loaded 2-core box)."""

    def __enter__(self) -> None:
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.threads)


# --- rounding one column ------------------------------------------------------------------
# ``round_column(w, s, z, q, deq)`` writes the codes of column ``w`` into ``q`` and their
# dequantized values into ``deq`` (both preallocated: the loop runs once per column and its
# cost is the number of torch calls).

def _int_rounder(grid: IntGrid) -> Callable:
    lo, hi = grid.qmin, grid.qmax

    def round_column(w, s, z, q, deq) -> None:
        torch.div(w, s, out=q)
        if z is None:
            q.round_().clamp_(lo, hi)
            torch.mul(q, s, out=deq)
        else:
            q.add_(z).round_().clamp_(lo, hi)
            torch.sub(q, z, out=deq).mul_(s)

    return round_column


def _fp8_round_column(w, s, z, q, deq) -> None:
    q.copy_(fp8.round_to_e4m3(w / s))
    torch.mul(q, s, out=deq)


# --- where each column's scale comes from -------------------------------------------------

class _Scales:
    """Scale (and zero point) of every column position in processing order.

    ``starts`` maps the position where a group's first column comes up to the group: its
    scale is found there, from the group's current (error-compensated) values. Without
    groups there is one scale (per tensor or per row), fixed up front. ``W`` is in the
    original column order, ``perm`` the processing order (None: the original one)."""

    def __init__(self, W: torch.Tensor, perm: torch.Tensor | None, grid, actorder: str | None,
                 observer: str) -> None:
        rows, cols = W.shape
        self.grid, self.observer = grid, observer
        self.starts: dict[int, int] = {}
        self.members: torch.Tensor | None = None  # group -> its positions
        if isinstance(grid, FP8Grid) or grid.group_size in (None, -1):
            if isinstance(grid, FP8Grid):
                self.scale, self.zero = fp8.weight_scale(W, grid.per_channel), None
                per_tensor = not grid.per_channel
            else:
                self.scale, self.zero = rtn.observe(W, grid, observer)
                per_tensor = grid.group_size is None
            pick = (lambda t: t[0]) if per_tensor else (lambda t: t[:, 0].contiguous())
            self.group_of = [0] * cols
            self.of_group = [(pick(self.scale), None if self.zero is None else pick(self.zero))]
            return
        size = grid.group_size
        n_groups = cols // size
        self.scale = torch.empty(rows, n_groups, device=W.device)
        self.zero = None if grid.symmetric else torch.empty(rows, n_groups, device=W.device)
        if actorder == "static":  # groups of the stored layout, visited in processing order
            self.group_of = (perm // size).tolist()
            self.members = torch.argsort(perm).reshape(n_groups, size)
        else:  # groups of consecutive processed columns (stored with a g_idx if permuted)
            self.group_of = [j // size for j in range(cols)]
            self.members = torch.arange(cols, device=W.device).reshape(n_groups, size)
        self.starts = {int(pos.min()): g for g, pos in enumerate(self.members)}
        self.of_group = [(None, None)] * n_groups

    def find(self, g: int, current: torch.Tensor) -> None:
        """Set group ``g``'s scale from its columns' current values (``size x rows``)."""
        scale, zero = rtn.observe(current.t(), IntGrid(self.grid.bits, self.grid.symmetric, -1),
                                  self.observer)
        self.scale[:, g] = scale[:, 0]
        if zero is not None:
            self.zero[:, g] = zero[:, 0]
        self.of_group[g] = (scale[:, 0], None if zero is None else zero[:, 0])


def _current_rows(positions: torch.Tensor, block: torch.Tensor, Wt: torch.Tensor,
                  i1: int, i2: int) -> torch.Tensor:
    """Current values of the given (not yet quantized) positions: in the block being
    processed (up to date) or after it (updated up to the previous block)."""
    here = positions < i2
    cur = torch.empty(len(positions), Wt.shape[1], device=Wt.device)
    cur[here] = block[positions[here] - i1]
    cur[~here] = Wt[positions[~here]]
    return cur


# --- the column loop ----------------------------------------------------------------------

def _column_views(block: torch.Tensor, codes: torch.Tensor, err: torch.Tensor, U: torch.Tensor,
                  n: int) -> list[tuple[torch.Tensor, ...]]:
    """For each column i of an n-column block: its value, code and error rows, the rows
    of the block's later columns and ``U[i, later]``. Made once per call and reused by
    every block: a view costs as much as one of the loop's arithmetic ops."""
    return [(block[i], codes[i], err[i], block[i + 1:n], U[i, i + 1:n]) for i in range(n)]


def quantize_columns(Wt: torch.Tensor, upper: torch.Tensor, scales: _Scales,
                     round_column: Callable, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's loop over the columns of W, held as the rows of ``Wt`` (cols x rows: a
    column is then a contiguous row). Updates ``Wt`` in place; returns the codes (as
    float, cols x rows) and each row's loss."""
    cols, rows = Wt.shape
    d = torch.diagonal(upper).clone().unbind(0)  # d_j as 0-dim tensors (cheaper than floats)
    Qt = torch.empty(cols, rows, device=Wt.device)
    losses = torch.zeros(rows, device=Wt.device)
    block, codes, Err = (torch.empty(block_size, rows, device=Wt.device) for _ in range(3))
    U = torch.empty(block_size, block_size, device=Wt.device)
    views: dict[int, list] = {}
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        n = i2 - i1
        block[:n] = Wt[i1:i2]
        U[:n, :n] = upper[i1:i2, i1:i2]
        if n not in views:
            views[n] = _column_views(block, codes, Err, U, n)
        for j, (w, q, err, later, u_later) in enumerate(views[n], start=i1):
            if j in scales.starts:
                g = scales.starts[j]
                scales.find(g, _current_rows(scales.members[g], block, Wt, i1, i2))
            s, z = scales.of_group[scales.group_of[j]]
            round_column(w, s, z, q, err)
            torch.sub(w, err, out=err).div_(d[j])  # err_j = (w_j - q_j) / d_j
            later.addr_(u_later, err, alpha=-1)  # eager, inside the block: w_F -= err_j U_jF
        Qt[i1:i2] = codes[:n]
        losses += Err[:n].square().sum(0) / 2
        Wt[i2:].addmm_(upper[i1:i2, i2:].t(), Err[:n], alpha=-1)  # lazy, after the block
    return Qt, losses


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, grid: IntGrid | FP8Grid, *,
                  block_size: int = 128, dampening: float = 0.01, actorder: str | None = None,
                  observer: str = "minmax") -> GPTQResult:
    """Quantize ``W`` (rows x cols) against the Hessian ``H`` (cols x cols).

    ``grid`` is an integer grid (any granularity) or FP8 E4M3 per tensor / channel.
    Falls back to round-to-nearest (``fallback=True``) when ``H`` cannot be inverted even
    with 100x the dampening.
    """
    if actorder not in ACTORDERS:
        raise ValueError(f"unknown actorder {actorder!r}; known: static, group or none")
    actorder = ACTORDER_ALIASES.get(actorder, actorder)
    is_fp8 = isinstance(grid, FP8Grid)
    grouped = not is_fp8 and grid.group_size not in (None, -1)
    if actorder == "group" and not grouped:
        actorder = "static"  # without groups the two orderings store the same thing
    H = H.float()
    dead = torch.diagonal(H) == 0  # inputs that never fire: any value is free
    W = W.float().clone()
    W[:, dead] = 0.0
    Wt = W.t().contiguous()  # processing order x rows: a column of W is a contiguous row
    perm = None
    if actorder:
        perm = torch.argsort(torch.where(dead, 1.0, torch.diagonal(H)), descending=True)
        H = H.index_select(0, perm).index_select(1, perm)  # (a copy)
        Wt, dead = Wt[perm], dead[perm]
    else:
        H = H.clone()
    H[dead, dead] = 1.0

    with single_thread():
        upper, used = inverse_hessian_cholesky(H, dampening)
        if upper is None:
            return _rtn_fallback(W, grid, observer)
        scales = _Scales(W, perm, grid, actorder, observer)
        if grouped and actorder != "static":
            # Whole groups per block, so a group's scale is found on up-to-date values.
            block_size = max(grid.group_size, block_size // grid.group_size * grid.group_size)
        round_column = _fp8_round_column if is_fp8 else _int_rounder(grid)
        Qt, losses = quantize_columns(Wt, upper, scales, round_column, block_size)

    Qt = Qt.to(torch.float8_e4m3fn if is_fp8 else torch.int8)
    g_idx = None
    if perm is not None:
        inverse = torch.argsort(perm)
        Qt = Qt[inverse]
        if actorder == "group":
            g_idx = torch.tensor(scales.group_of, dtype=torch.int32, device=W.device)[inverse]
    Q = Qt.t().contiguous()
    return GPTQResult(Q, scales.scale, scales.zero, g_idx, float(losses.sum()), used, False,
                      None if is_fp8 else grid.group_size)


def _rtn_fallback(W: torch.Tensor, grid, observer: str) -> GPTQResult:
    if isinstance(grid, FP8Grid):
        scale = fp8.weight_scale(W, grid.per_channel)
        return GPTQResult(fp8.quantize(W, scale), scale, None, None, float("nan"), None, True)
    q, scale, zero = rtn.rtn_quantize(W, grid, observer)
    return GPTQResult(q, scale, zero, None, float("nan"), None, True, grid.group_size)
