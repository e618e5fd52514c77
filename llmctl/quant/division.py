"""Division by a constant, rounded the same on every device.

A scale is ``amax / c`` (``c`` = 7.5 for int4, 448 for E4M3). CUDA's true division by a
Python scalar multiplies by the float32 reciprocal ``1/c`` (PyTorch's
``div_true_kernel_cuda``: "may lose one bit of precision"), the CPU divides; the two scales
then differ in the last bit for some ``amax``, and every weight whose ``w / scale`` lies at
a rounding tie takes the other code. bf16-valued weights hit exact ties often (0.6% of a
tiny model's int4 codes differed between an H200 and the CPU). Dividing by a tensor on the
same device makes both run IEEE division, correctly rounded: the same bits everywhere.
"""

from __future__ import annotations

import torch


def div_const(x: torch.Tensor, c: float) -> torch.Tensor:
    """``x / c``, correctly rounded in ``x``'s dtype on the CPU and on CUDA alike."""
    return x / torch.full((), c, dtype=x.dtype, device=x.device)
