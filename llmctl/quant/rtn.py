"""Round-to-nearest onto an integer grid: the baseline every other method is measured against.

Conventions (those of compressed-tensors, so a checkpoint means the same in every reader):

- ``q`` is a signed integer in ``[-2^(b-1), 2^(b-1) - 1]`` held in int8;
  ``w ~= (q - zero) * scale``; symmetric grids have no zero point (zero = 0).
- granularity is a ``group_size``: ``None`` one scale per tensor (shape ``(1,)``),
  ``-1`` one per output channel (``(rows, 1)``), ``g > 0`` one per ``g`` consecutive
  input columns of each row (``(rows, cols // g)``).
- symmetric scale = amax / ((2^b - 1) / 2): the grid spans [-amax, amax] with 2^b
  levels, so the most negative code is used too (amax/7.5 for int4, amax/127.5 for int8).
- asymmetric: scale = (max - min) / (2^b - 1) with 0 kept inside the range, and an
  integer zero point so that ``min`` lands on the lowest code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl.quant.division import div_const


@dataclass(frozen=True)
class IntGrid:
    bits: int
    symmetric: bool = True
    group_size: int | None = None  # None: per tensor, -1: per channel, g > 0: per group

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def groups(self, cols: int) -> int:
        if self.group_size is None or self.group_size == -1:
            return 1
        return cols // self.group_size


def _grouped(w: torch.Tensor, grid: IntGrid) -> torch.Tensor:
    """View ``w`` as ``[rows, groups, group_len]`` (per tensor: one row, one group)."""
    if grid.group_size is None:
        return w.reshape(1, 1, -1)
    if grid.group_size == -1:
        return w.reshape(w.shape[0], 1, -1)
    rows, cols = w.shape
    if cols % grid.group_size:
        raise ValueError(f"group size {grid.group_size} does not divide {cols} columns")
    return w.reshape(rows, cols // grid.group_size, grid.group_size)


def _scale_shape(w: torch.Tensor, grid: IntGrid) -> tuple[int, ...]:
    if grid.group_size is None:
        return (1,)
    return (w.shape[0], grid.groups(w.shape[1]))


def params_from_range(lo: torch.Tensor, hi: torch.Tensor,
                      grid: IntGrid) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point covering ``[lo, hi]`` (elementwise tensors of any shape)."""
    lo = torch.clamp(lo.float(), max=0.0)
    hi = torch.clamp(hi.float(), min=0.0)
    levels = float((1 << grid.bits) - 1)
    if grid.symmetric:
        scale = div_const(torch.maximum(-lo, hi), levels / 2)
        zero = None
    else:
        scale = div_const(hi - lo, levels)
    # An all-zero group quantizes to code 0 with any scale; 1 avoids 0/0.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if not grid.symmetric:
        zero = torch.clamp(torch.round(grid.qmin - lo / scale), grid.qmin, grid.qmax)
    return scale, zero


def minmax_params(w: torch.Tensor, grid: IntGrid,
                  shrink: float | torch.Tensor = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales from each group's min/max, optionally clipped by ``shrink`` in (0, 1]."""
    g = _grouped(w.float(), grid)
    lo, hi = g.amin(dim=-1) * shrink, g.amax(dim=-1) * shrink
    scale, zero = params_from_range(lo, hi, grid)
    shape = _scale_shape(w, grid)
    return scale.reshape(shape), None if zero is None else zero.reshape(shape)


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
             grid: IntGrid) -> torch.Tensor:
    """Integer codes (int8) of ``w`` on the grid given by ``scale``/``zero``."""
    g = _grouped(w.float(), grid)
    s = scale.float().reshape(g.shape[0], g.shape[1], 1)
    x = g / s
    if zero is not None:
        x = x + zero.float().reshape(s.shape)
    q = torch.clamp(torch.round(x), grid.qmin, grid.qmax)
    return q.to(torch.int8).reshape(w.shape)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
               grid: IntGrid, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = _grouped(q.float(), grid)
    s = scale.float().reshape(g.shape[0], g.shape[1], 1)
    if zero is not None:
        g = g - zero.float().reshape(s.shape)
    return (g * s).reshape(q.shape).to(dtype)


def fake_quantize(w: torch.Tensor, grid: IntGrid, scale: torch.Tensor | None = None,
                  zero: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize then dequantize (min/max scales unless given)."""
    if scale is None:
        scale, zero = minmax_params(w, grid)
    return dequantize(quantize(w, scale, zero, grid), scale, zero, grid, w.dtype)


def fake_quantize_groups(g: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                         grid: IntGrid) -> torch.Tensor:
    """Quantize-dequantize grouped weights ``g`` [..., groups, size] with one scale (and
    zero) per group [..., groups]: the inner step of every clipping search."""
    x = g / scale.unsqueeze(-1)
    if zero is not None:
        x = x + zero.unsqueeze(-1)
    q = torch.clamp(torch.round(x), grid.qmin, grid.qmax)
    if zero is not None:
        q = q - zero.unsqueeze(-1)
    return q * scale.unsqueeze(-1)


def mse_params(w: torch.Tensor, grid: IntGrid, *, steps: int = 20, max_shrink: float = 0.20,
               norm: float = 2.4) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-group clipping search: try ranges shrunk by up to ``max_shrink`` and keep the
    one with the smallest ``sum |w - Q(w)|^norm`` (GPTQ's ``mse`` observer uses p = 2.4)."""
    g = _grouped(w.float(), grid)
    lo0, hi0 = g.amin(dim=-1), g.amax(dim=-1)
    best_err = torch.full(lo0.shape, float("inf"))
    best_scale, best_zero = params_from_range(lo0, hi0, grid)
    for i in range(steps + 1):
        factor = 1.0 - max_shrink * i / steps
        scale, zero = params_from_range(lo0 * factor, hi0 * factor, grid)
        err = (fake_quantize_groups(g, scale, zero, grid) - g).abs().pow(norm).sum(dim=-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        if zero is not None:
            best_zero = torch.where(better, zero, best_zero)
    shape = _scale_shape(w, grid)
    return best_scale.reshape(shape), None if best_zero is None else best_zero.reshape(shape)


OBSERVERS = {"minmax": minmax_params, "memoryless_minmax": minmax_params, "mse": mse_params}


def observe(w: torch.Tensor, grid: IntGrid, observer: str = "minmax"):
    try:
        fn = OBSERVERS[observer]
    except KeyError:
        raise ValueError(f"unknown observer {observer!r}; known: {', '.join(OBSERVERS)}") from None
    return fn(w, grid)


def rtn_quantize(w: torch.Tensor, grid: IntGrid, observer: str = "minmax"
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest: ``(q, scale, zero)``."""
    scale, zero = observe(w, grid, observer)
    return quantize(w, scale, zero, grid), scale, zero


# --- activations -------------------------------------------------------------------

def fake_quantize_per_token(x: torch.Tensor, bits: int = 8, symmetric: bool = True) -> torch.Tensor:
    """Dynamic per-token (last-dim rows) integer quantize-dequantize, as at inference."""
    grid = IntGrid(bits, symmetric, -1)
    flat = x.reshape(-1, x.shape[-1])
    return fake_quantize(flat.float(), grid).reshape(x.shape).to(x.dtype)


def fake_quantize_static(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                         bits: int = 8) -> torch.Tensor:
    """Static per-tensor integer quantize-dequantize with calibrated ``scale``/``zero``."""
    s = scale.float().reshape(())
    q = x.float() / s
    if zero is not None:
        q = q + zero.float().reshape(())
    q = torch.clamp(torch.round(q), -(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    if zero is not None:
        q = q - zero.float().reshape(())
    return (q * s).to(x.dtype)
