"""AWQ's scale and clip searches on synthetic layers with outlier input channels."""

import pytest
import torch

from llmctl.quant import awq, rtn
from llmctl.quant.rtn import IntGrid


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    cols = 128
    loud = torch.ones(cols)
    loud[torch.randperm(cols)[:4]] = 25.0  # salient channels (section 3.1 of the paper)
    X = torch.randn(4096, cols) * loud
    W = torch.randn(96, cols) * 0.05
    return X, W, X.t() @ X / X.shape[0]


def test_output_error_is_the_direct_mean_squared_error(layer):
    X, W, H = layer
    E = rtn.fake_quantize(W, IntGrid(4, True, 32)) - W
    direct = ((X @ E.t()) ** 2).sum(dim=1).mean().item() / W.shape[0]
    assert awq.output_error(E, H).item() == pytest.approx(direct, rel=1e-4)


@pytest.mark.parametrize("symmetric", [True, False])
def test_scaled_quantization_error_is_lower_than_unscaled(layer, symmetric):
    X, W, H = layer
    grid = IntGrid(4, symmetric, 32)
    found = awq.search_scales([W[:48], W[48:]], H, X.abs().mean(dim=0), grid)
    assert 0.0 < found.alpha < 1.0
    # measured directly on the calibration inputs, not through the search's own formula
    s = found.scales
    scaled = rtn.fake_quantize(W * s, grid) / s
    plain = rtn.fake_quantize(W, grid)
    err_scaled = ((X @ (scaled - W).t()) ** 2).mean().item()
    err_plain = ((X @ (plain - W).t()) ** 2).mean().item()
    assert err_scaled < 0.7 * err_plain
    assert found.loss < found.loss_unscaled


def test_scales_are_normalised_around_one(layer):
    X, W, _ = layer
    s = awq.candidate_scales(X.abs().mean(dim=0), awq.weight_channel_mean([W], 32), 0.5)
    assert (s.max() * s.min()).item() == pytest.approx(1.0, rel=1e-5)


def test_clip_search_lowers_group_error(layer):
    _, W, H = layer
    heavy = W.clone()
    heavy[:, ::16] *= 6.0  # one outlier weight per group makes min/max ranges loose
    grid = IntGrid(4, True, 32)
    scale, zero = awq.clip_search(heavy, H, grid)
    clipped = rtn.dequantize(rtn.quantize(heavy, scale, zero, grid), scale, zero, grid)
    plain = rtn.fake_quantize(heavy, grid)
    assert awq.output_error(clipped - heavy, H) <= awq.output_error(plain - heavy, H)


def test_scale_hessian_matches_smoothed_inputs(layer):
    X, _, H = layer
    s = torch.rand(X.shape[1]) + 0.5
    Xs = X / s
    assert torch.allclose(awq.scale_hessian(H, s), Xs.t() @ Xs / X.shape[0], rtol=1e-4, atol=1e-4)
