"""GPTQ (Frantar et al. 2022, arXiv:2210.17323): quantize a weight column by column and
push each column's rounding error onto the columns not yet quantized.

For a linear layer with inputs X (tokens x cols) the loss of a quantized W' is
``||(W - W') X^T||^2 = tr((W - W') H (W - W')^T) / 2`` with ``H = 2 X^T X``. Quantizing
column j and compensating optimally with the remaining columns F gives (OBS, eq. 3):

    delta_F = -(w_j - q_j) / [H_F^-1]_jj * (H_F^-1)_{j,:}

Section 3.3 notes that all the ``H_F^-1`` rows needed, in a fixed column order, are the
rows of the upper Cholesky factor U of ``H^-1``; section 3.2 ("lazy batch updates")
applies the updates inside a block of B columns eagerly and to the rest of the matrix
once per block, as one matmul. Dampening (section 5, "percdamp") adds
``percdamp * mean(diag H)`` to the diagonal so the inverse exists.

Activation ordering ("act-order") processes columns by decreasing ``diag(H)`` (most
active inputs first, while there are many columns left to absorb their error):

- ``static`` (compressed-tensors "weight"): group scales are fixed up front from the
  original weight, groups stay contiguous in the stored layout, no extra tensor;
- ``group``: groups are formed in processing order, which needs a ``g_idx`` (column ->
  group) at inference time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl.quant import fp8, rtn
from llmctl.quant.fp8 import FP8Grid
from llmctl.quant.rtn import IntGrid

ACTORDERS = (None, "static", "weight", "group", "dynamic")


@dataclass
class GPTQResult:
    q: torch.Tensor  # int8 codes (float8_e4m3fn for FP8), original column order
    scale: torch.Tensor
    zero: torch.Tensor | None
    g_idx: torch.Tensor | None  # only for act-order "group"
    loss: float  # the GPTQ objective's increase, sum over rows
    dampening: float | None  # the dampening fraction that worked; None after a fallback
    fallback: bool = False  # True: the Hessian could not be inverted, RTN was used

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.q.dtype == torch.float8_e4m3fn:
            return fp8.dequantize(self.q, self.scale, dtype)
        return dequantize(self.q, self.scale, self.zero, self.g_idx, self.group_size, dtype)

    group_size: int | None = None


class HessianAccumulator:
    """Running ``H = 2/n * sum x x^T`` over calibration inputs (rows of ``x``)."""

    def __init__(self, cols: int, device=None) -> None:
        self.sum = torch.zeros(cols, cols, dtype=torch.float32, device=device)
        self.count = 0

    # A 16-bit matmul accumulates in float32 internally but rounds its result to 16 bits;
    # summing many such partial products (of LOWP_ROWS inputs each) into a float32 total
    # keeps the Hessian's relative error near 2e-4 at half the cost of a float32 matmul
    # (measured: GPTQ's output error changes by < 0.05%).
    LOWP_ROWS = 1024

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        if x.dtype in (torch.bfloat16, torch.float16):
            for part in x.split(self.LOWP_ROWS):
                self.sum += (part.t() @ part).float()
        else:
            x = x.float()
            self.sum.addmm_(x.t(), x)
        self.count += x.shape[0]

    def hessian(self) -> torch.Tensor:
        return self.sum * (2.0 / max(self.count, 1))


def inverse_hessian_cholesky(H: torch.Tensor, dampening: float,
                             boosts: tuple[float, ...] = (1.0, 10.0, 100.0)
                             ) -> tuple[torch.Tensor | None, float | None]:
    """Upper Cholesky factor of ``(H + damp*I)^-1``, raising the dampening on failure."""
    mean_diag = torch.diagonal(H).mean()
    for boost in boosts:
        frac = dampening * boost
        damped = H.clone()
        damped.diagonal().add_(frac * mean_diag)
        lower, info = torch.linalg.cholesky_ex(damped)
        if info.item() != 0:
            continue
        upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
        if info.item() == 0 and torch.isfinite(upper).all():
            return upper, frac
    return None, None


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


def _column_params(w: torch.Tensor, grid: IntGrid, observer: str):
    """Per-row scale/zero of one group of columns ``w`` (rows x group)."""
    scale, zero = rtn.observe(w, IntGrid(grid.bits, grid.symmetric, -1), observer)
    return scale[:, 0], None if zero is None else zero[:, 0]


def _rtn_fallback(W: torch.Tensor, grid, observer: str) -> GPTQResult:
    if isinstance(grid, FP8Grid):
        scale = fp8.weight_scale(W, grid.per_channel)
        return GPTQResult(fp8.quantize(W, scale), scale, None, None, float("nan"), None, True)
    q, scale, zero = rtn.rtn_quantize(W, grid, observer)
    return GPTQResult(q, scale, zero, None, float("nan"), None, True, grid.group_size)


class single_thread:
    """Run the column loop on one thread: its ops are tiny, and a thread pool's
    synchronisation costs more than it saves (badly so on a busy machine: measured
    0.3 s on one thread vs 4-9 s on two for a 960 x 576 weight on a loaded 2-core box)."""

    def __enter__(self) -> None:
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.threads)


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, grid: IntGrid | FP8Grid, *,
                  block_size: int = 128,
                  dampening: float = 0.01, actorder: str | None = None,
                  observer: str = "minmax") -> GPTQResult:
    """Quantize ``W`` (rows x cols) against the Hessian ``H`` (cols x cols).

    ``grid`` is an integer grid (any granularity) or FP8 E4M3 per tensor / channel; FP8
    scales are fixed up front and each column is rounded to the E4M3 grid.
    """
    with single_thread():
        return _gptq(W, H, grid, block_size=block_size, dampening=dampening,
                     actorder=actorder, observer=observer)


def _gptq(W: torch.Tensor, H: torch.Tensor, grid: IntGrid | FP8Grid, *, block_size: int,
          dampening: float, actorder: str | None, observer: str) -> GPTQResult:
    if actorder not in ACTORDERS:
        raise ValueError(f"unknown actorder {actorder!r}; known: static, group or none")
    actorder = {"weight": "static", "dynamic": "group"}.get(actorder, actorder)
    W = W.float().clone()
    H = H.float().clone()
    rows, cols = W.shape
    is_fp8 = isinstance(grid, FP8Grid)
    grouped = not is_fp8 and grid.group_size not in (None, -1)
    if actorder == "group" and not grouped:
        actorder = "static"  # without groups the two orderings store the same thing

    dead = torch.diagonal(H) == 0  # inputs that never fire: any value is free
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    perm = torch.argsort(torch.diagonal(H), descending=True) if actorder else None
    if perm is not None:
        W = W[:, perm]
        H = H[perm][:, perm]
    upper, used = inverse_hessian_cholesky(H, dampening)
    if upper is None:
        return _rtn_fallback(W if perm is None else W[:, torch.argsort(perm)], grid, observer)

    # Which group (scale column) each processed position uses, and whether scales are
    # fixed up front (per tensor / channel / static groups) or found when a group starts
    # on the error-compensated weights (the original GPTQ, and act-order "group").
    on_the_fly = grouped and actorder != "static"
    if is_fp8:
        unpermuted = W if perm is None else W[:, torch.argsort(perm)]
        scale, zero = fp8.weight_scale(unpermuted, grid.per_channel), None
        group_of = [0] * cols
    elif not grouped:
        unpermuted = W if perm is None else W[:, torch.argsort(perm)]
        scale, zero = rtn.observe(unpermuted, grid, observer)
        group_of = [0] * cols
    elif actorder == "static":
        # Groups stay contiguous in the stored layout, but their scales are found when
        # the first of their columns comes up, from the error-compensated weights (scales
        # fixed from the original weights clip the compensation, worse for small groups).
        n_groups = cols // grid.group_size
        scale = torch.empty(rows, n_groups, device=W.device)
        zero = None if grid.symmetric else torch.empty(rows, n_groups, device=W.device)
        group_of = (perm // grid.group_size).tolist()
        members = torch.argsort(perm).reshape(n_groups, grid.group_size)  # positions
        pending = set(range(n_groups))
    else:
        n_groups = cols // grid.group_size
        scale = torch.empty(rows, n_groups, device=W.device)
        zero = None if grid.symmetric else torch.empty(rows, n_groups, device=W.device)
        group_of = [j // grid.group_size for j in range(cols)]
    if on_the_fly:
        # Align blocks to groups so each group is quantized inside one up-to-date block.
        block_size = max(grid.group_size, block_size // grid.group_size * grid.group_size)

    per_tensor = (not grid.per_channel) if is_fp8 else grid.group_size is None
    columns: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # group -> (s, z)

    def group_params(g: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        # contiguous copies: the loop below reads them once per column
        if g not in columns:
            s_g = scale[0] if per_tensor else scale[:, g].contiguous()
            z_g = None if zero is None else (zero[0] if per_tensor else zero[:, g].contiguous())
            columns[g] = (s_g, z_g)
        return columns[g]

    # The loop runs once per column with tiny ops, so its cost is the number of torch
    # calls: results go straight into Qt/Err rows (``out=``), the diagonal is read as
    # Python floats, the rank-one update is one ``addr_`` and the loss is summed per block.
    diag = torch.diagonal(upper).tolist()
    # Work on W^T so that a column of W is a contiguous row: the inner loop touches one
    # column and a rank-one update per step, both cheap in this layout.
    Wt = W.t().contiguous()
    Qt = torch.empty(cols, rows, dtype=torch.float32, device=W.device)  # codes, cast at the end
    losses = torch.zeros(rows, device=W.device)
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        B = Wt[i1:i2].clone()
        U1 = upper[i1:i2, i1:i2]
        Err = torch.empty_like(B)
        for i in range(i2 - i1):
            j = i1 + i
            g = group_of[j]
            if on_the_fly and j % grid.group_size == 0:
                s_g, z_g = _column_params(B[i:i + grid.group_size].t(), grid, observer)
                scale[:, g] = s_g
                if zero is not None:
                    zero[:, g] = z_g
                columns.pop(g, None)
            elif actorder == "static" and grouped and g in pending:
                # Current values of the group's columns: in this block (up to date) or
                # later (updated up to the previous block).
                pos = members[g]
                here = pos < i2
                cur = torch.empty(grid.group_size, rows, device=W.device)
                cur[here] = B[pos[here] - i1]
                cur[~here] = Wt[pos[~here]]
                s_g, z_g = _column_params(cur.t(), grid, observer)
                scale[:, g] = s_g
                if zero is not None:
                    zero[:, g] = z_g
                pending.discard(g)
            s, z = group_params(g)
            w, q, err = B[i], Qt[j], Err[i]
            if is_fp8:
                q.copy_(fp8.round_to_e4m3(w / s))
                deq = q * s
            else:
                torch.div(w, s, out=q)
                if z is not None:
                    q.add_(z)
                q.round_().clamp_(grid.qmin, grid.qmax)
                deq = q * s if z is None else (q - z) * s
            torch.sub(w, deq, out=err).div_(diag[j])
            # Eager update inside the block (rank one); the rest waits for the block end.
            if i + 1 < i2 - i1:
                B[i + 1:].addr_(U1[i, i + 1:], err, alpha=-1)
        losses += Err.square().sum(0) / 2
        Wt[i2:].addmm_(upper[i1:i2, i2:].t(), Err, alpha=-1)
    Q = Qt.t().to(torch.float8_e4m3fn if is_fp8 else torch.int8)

    g_idx = None
    if perm is not None:
        inverse = torch.argsort(perm)
        Q = Q[:, inverse]
        if actorder == "group":
            g_idx = torch.tensor(group_of, dtype=torch.int32, device=W.device)[inverse]
    return GPTQResult(Q, scale, zero, g_idx, float(losses.sum()), used, False,
                      None if is_fp8 else grid.group_size)
