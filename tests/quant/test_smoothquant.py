"""SmoothQuant migration: the float output is unchanged, activation outliers shrink."""

import torch

from llmctl.quant import rtn, smoothquant


def test_migration_keeps_outputs_and_flattens_activations():
    torch.manual_seed(0)
    loud = torch.ones(64)
    loud[:3] = 50.0
    X = torch.randn(512, 64) * loud
    W = torch.randn(32, 64) * 0.1
    s = smoothquant.smoothing_scales(X.abs().amax(dim=0), [W], alpha=0.5)
    assert torch.allclose((X / s) @ (W * s).t(), X @ W.t(), rtol=1e-4, atol=1e-3)
    before = X.abs().amax(dim=0)
    after = (X / s).abs().amax(dim=0)
    assert after.max() / after.min() < before.max() / before.min()
    # and per-token int8 activation quantization gets more accurate
    err = lambda x, w: ((rtn.fake_quantize_per_token(x, 8) @ w.t() - X @ W.t()) ** 2).mean()
    assert err(X / s, W * s) < err(X, W)


def test_alpha_zero_and_one_are_the_extremes():
    a = torch.tensor([4.0, 1.0])
    w = torch.tensor([[2.0, 8.0]])
    assert torch.allclose(smoothquant.smoothing_scales(a, [w], alpha=1.0), a)
    assert torch.allclose(smoothquant.smoothing_scales(a, [w], alpha=0.0), 1 / w[0])
