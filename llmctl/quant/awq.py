"""AWQ (Lin et al. 2023, arXiv:2306.00978): activation-aware per-input-channel scaling.

Scaling input channel j of the balanced linears by ``s_j`` and dividing the op that
produces their input (a norm's weight, or the previous linear's rows) by ``s_j`` leaves
the float model unchanged but moves quantization error away from channels with large
activations (section 3.2): ``Q(W diag(s)) diag(s)^-1 X`` instead of ``Q(W) X``.

Scales come from a grid search over ``alpha`` in [0, 1) (``n_grid`` points):

    s = mean|x|^alpha / mean_w^(1 - alpha)     (duo scaling; mean|x|^alpha otherwise)
    s = s / sqrt(max(s) * min(s))

where ``mean_w`` is each input channel's mean |w| after normalising every quantization
group to max 1 (as AutoAWQ / llm-compressor do). The search minimises the balanced
linears' output error on the calibration set. llmctl evaluates that error in closed
form from the inputs' second moment ``H = X^T X / n``:

    ||(W' - W) X^T||^2 / n = tr((W' - W) H (W' - W)^T)

which is exact for the linears' outputs, needs one ``rows x cols x cols`` product per
grid point instead of a pass over all tokens, and so uses every calibration token.
Callers may instead pass a ``loss_fn`` measuring the error after the whole attention or
MLP block (AutoAWQ's ``module2inspect``), which also weighs how the error propagates
through softmax / SwiGLU and the following projection.

Optional clipping (AutoAWQ's ``auto_clip``): per row and group, shrink the range to
``(1 - k/n_grid) * max`` for ``k < n_grid * max_shrink`` and keep the one with the
smallest group output error, ``e H_gg e^T`` (e the group's weight error).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmctl.quant import rtn
from llmctl.quant.rtn import IntGrid


def output_error(w_err: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """Mean squared output error ``tr(E H E^T) / rows`` for weight error ``E``.

    ``H`` may be bf16 to halve the cost of the search (the product accumulates in float32
    inside the matmul; only its result is rounded, which does not change the ranking)."""
    return ((w_err.to(H.dtype) @ H).float() * w_err).sum() / w_err.shape[0]


def weight_channel_mean(weights: list[torch.Tensor], group_size: int | None) -> torch.Tensor:
    """Mean over output rows of |w| normalised to max 1 within each quantization group."""
    w = torch.cat([x.float() for x in weights], dim=0).abs()
    rows, cols = w.shape
    g = cols if group_size in (None, -1) else group_size
    grouped = w.reshape(rows, cols // g, g)
    grouped = grouped / (grouped.amax(dim=-1, keepdim=True) + 1e-6)
    return grouped.reshape(rows, cols).mean(dim=0)


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, alpha: float,
                     duo: bool = True) -> torch.Tensor:
    x_mean = x_mean.float()
    if duo:
        s = (x_mean.pow(alpha) / (w_mean.float().pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
    else:
        s = x_mean.pow(alpha).clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


@dataclass
class ScaleSearch:
    scales: torch.Tensor  # per input channel; multiply the balanced weights' columns
    alpha: float
    loss: float  # output MSE at the chosen scales
    loss_unscaled: float  # output MSE of plain round-to-nearest (alpha = 0, s = 1)


def search_scales(weights: list[torch.Tensor], H: torch.Tensor | None, x_mean: torch.Tensor,
                  grid: IntGrid, *, n_grid: int = 20, duo_scaling: bool = True,
                  matmul_dtype: torch.dtype = torch.float32,
                  loss_fn: Callable[[list[torch.Tensor]], float] | None = None) -> ScaleSearch:
    """Grid-search AWQ scales for linears sharing one input (statistics ``H``, ``x_mean``).

    The default loss is the linears' own output error from ``H``. ``loss_fn`` replaces it:
    it receives the effective weights ``Q(W s) / s`` of each linear (to apply to the
    unscaled inputs) and returns the error of whatever block output the caller measures.
    """
    W = torch.cat([w.float() for w in weights], dim=0)
    rows = [w.shape[0] for w in weights]
    if loss_fn is None:
        H = H.to(matmul_dtype)

        def loss_fn(effective: list[torch.Tensor]) -> float:
            return float(output_error(torch.cat(effective, dim=0) - W, H))

    w_mean = weight_channel_mean(weights, grid.group_size)
    base = loss_fn(list(rtn.fake_quantize(W, grid).split(rows)))
    best = ScaleSearch(torch.ones_like(x_mean, dtype=torch.float32), 0.0, base, base)
    for k in range(n_grid):
        alpha = k / n_grid
        s = candidate_scales(x_mean, w_mean, alpha, duo_scaling)
        effective = rtn.fake_quantize(W * s, grid) / s
        loss = loss_fn(list(effective.split(rows)))
        if loss < best.loss:
            best = ScaleSearch(s, alpha, loss, base)
    return best


def clip_search(W: torch.Tensor, H: torch.Tensor, grid: IntGrid, *, n_grid: int = 20,
                max_shrink: float = 0.5) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-(row, group) range shrink minimising the group's output error; ``(scale, zero)``."""
    W = W.float()
    rows, cols = W.shape
    gsize = cols if grid.group_size in (None, -1) else grid.group_size
    if grid.group_size is None:
        return rtn.minmax_params(W, grid)  # one scale for the tensor: nothing per group
    n_groups = cols // gsize
    g = W.reshape(rows, n_groups, gsize)
    idx = torch.arange(n_groups, device=W.device)
    # Diagonal blocks of H, one gsize x gsize block per group.
    blocks = H.float().reshape(n_groups, gsize, n_groups, gsize)[idx, :, idx, :]
    lo0, hi0 = g.amin(dim=-1), g.amax(dim=-1)
    best_err = torch.full((rows, n_groups), float("inf"), device=W.device)
    best_scale, best_zero = rtn.params_from_range(lo0, hi0, grid)
    for k in range(int(n_grid * max_shrink)):
        factor = 1.0 - k / n_grid
        scale, zero = rtn.params_from_range(lo0 * factor, hi0 * factor, grid)
        e = rtn.fake_quantize_groups(g, scale, zero, grid) - g
        err = torch.einsum("rgi,gij,rgj->rg", e, blocks, e)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        if zero is not None:
            best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def scale_hessian(H: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Second moment of the smoothed inputs ``x / s``: ``diag(1/s) H diag(1/s)``."""
    inv = 1.0 / scales.float()
    return H * inv.unsqueeze(0) * inv.unsqueeze(1)
