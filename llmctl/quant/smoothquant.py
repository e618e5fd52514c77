"""SmoothQuant (Xiao et al. 2023, arXiv:2211.10438): migrate activation outliers into
the weights before W8A8 quantization.

Per input channel j (section 4, eq. 4), with alpha the migration strength:

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

then ``X_j / s_j`` (folded into the norm or linear producing X) and ``W_j * s_j`` keep
``X W^T`` unchanged while flattening the per-channel activation range that per-token
int8 quantization has to cover. ``max|W_j|`` is taken over every balanced linear.
"""

from __future__ import annotations

import torch


def smoothing_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor],
                     alpha: float = 0.5, eps: float = 1e-5) -> torch.Tensor:
    w_absmax = torch.cat([w.float().abs() for w in weights], dim=0).amax(dim=0)
    a = act_absmax.float().clamp(min=eps)
    s = a.pow(alpha) / w_absmax.clamp(min=eps).pow(1 - alpha)
    s = torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
    return s.clamp(min=eps)
