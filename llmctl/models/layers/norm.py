"""RMSNorm, ``y = x / sqrt(mean(x^2) + eps) * (offset + w)`` over the last dimension.

Two orders of the same formula, each kept where its numbers are needed:

- :func:`rms_norm` is transformers' order, the reference: normalise in float32, cast
  back to ``x``'s dtype, then scale in that dtype. The quantizer calibrates on what
  transformers computes, so its block forward uses this one (in bfloat16 it differs
  from torch's fused op in the last bit).
- :func:`fused_rms_norm` is torch's ``rms_norm`` op, one kernel: the engine's and the
  static decoder's choice (equal to the reference in float32).

A family's variant is data (:class:`RMSNorm`): Gemma stores ``w - 1`` and scales by
``1 + w``, in float32 before the cast (its transformers RMSNorm); ``offset`` says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmctl.models.spec import ModelArch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             offset: float = 0.0) -> torch.Tensor:
    """transformers' RMSNorm (``weight`` None: no scale)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return xf.to(x.dtype)
    if offset:  # Gemma: (offset + w) in float32, then the cast
        return (xf * (offset + weight.float())).to(x.dtype)
    return weight.to(x.dtype) * xf.to(x.dtype)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                   offset: float = 0.0) -> torch.Tensor:
    """torch's RMSNorm op over the last dimension (a loader may fold ``offset`` into the
    weight once instead of adding it per call)."""
    if offset and weight is not None:
        weight = weight + offset
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``x += residual`` in place (when given), return ``fused_rms_norm(x) * weight``: the
    residual stream's add fused with the norm that follows it."""
    if residual is not None:
        x.add_(residual)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


@dataclass(frozen=True)
class RMSNorm:
    """A family's RMSNorm as data: ``eps`` and the weight ``offset`` (Gemma: 1)."""

    eps: float
    offset: float = 0.0

    @classmethod
    def of(cls, arch: ModelArch) -> RMSNorm:
        return cls(arch.rms_norm_eps, arch.family.norm_offset)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return rms_norm(x, weight, self.eps, self.offset)

    def fused(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return fused_rms_norm(x, weight, self.eps, self.offset)
