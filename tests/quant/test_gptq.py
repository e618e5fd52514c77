"""GPTQ on synthetic layers: lower output error than round-to-nearest, and its fallbacks."""

import pytest
import torch

from llmctl.quant import fp8, rtn
from llmctl.quant.fp8 import FP8Grid
from llmctl.quant.gptq import gptq_quantize, inverse_hessian_cholesky, lower_triangular_inverse
from llmctl.quant.hessian import HessianAccumulator
from llmctl.quant.rtn import IntGrid


def _correlated_inputs(n=2048, cols=128, seed=0):
    torch.manual_seed(seed)
    mix = torch.randn(cols, cols) * 0.3 + torch.eye(cols)  # correlated features
    loud = torch.ones(cols)
    loud[:4] = 8.0  # a few outlier channels, as in LLM activations
    return (torch.randn(n, cols) @ mix) * loud


def _output_error(X, W, Wq):
    return ((X @ (W - Wq).t()) ** 2).mean().item()


@pytest.fixture(scope="module")
def layer():
    X = _correlated_inputs()
    torch.manual_seed(1)
    W = torch.randn(64, X.shape[1])
    acc = HessianAccumulator(X.shape[1])
    for chunk in X.split(500):
        acc.add(chunk)
    return X, W, acc.hessian()


def test_hessian_is_two_x_transpose_x_over_n(layer):
    X, _, H = layer
    assert torch.allclose(H, 2 * X.t() @ X / X.shape[0], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("group_size", [None, -1, 32])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("actorder", [None, "static", "group"])
def test_gptq_beats_round_to_nearest(layer, group_size, symmetric, actorder):
    X, W, H = layer
    grid = IntGrid(4, symmetric, group_size)
    q, s, z = rtn.rtn_quantize(W, grid)
    rtn_err = _output_error(X, W, rtn.dequantize(q, s, z, grid))
    res = gptq_quantize(W, H, grid, actorder=actorder)
    assert not res.fallback and res.dampening == pytest.approx(0.01)
    assert res.q.dtype == torch.int8 and res.q.shape == W.shape
    assert (res.g_idx is not None) == (actorder == "group" and group_size == 32)
    gptq_err = _output_error(X, W, res.dequantize())
    assert gptq_err < 0.5 * rtn_err


def test_gptq_loss_is_the_final_objective(layer):
    _, W, H = layer
    res = gptq_quantize(W, H, IntGrid(4, True, 32))
    # The OBS increments add up to tr(E H' E^T) / 2 for the final error E, with H' the
    # dampened Hessian GPTQ actually inverts.
    E = W - res.dequantize()
    damped = H + res.dampening * torch.diagonal(H).mean() * torch.eye(H.shape[0])
    assert res.loss == pytest.approx(((E @ damped) * E).sum().item() / 2, rel=1e-2)


def test_static_actorder_keeps_contiguous_groups(layer):
    _, W, H = layer
    grid = IntGrid(4, True, 32)
    res = gptq_quantize(W, H, grid, actorder="static")
    assert res.g_idx is None
    # the stored codes decode with plain contiguous groups
    assert torch.equal(res.dequantize(), rtn.dequantize(res.q, res.scale, None, grid))


def test_gptq_fp8_beats_round_to_nearest(layer):
    X, W, H = layer
    codes, scale = fp8.rtn_quantize(W, FP8Grid(per_channel=True))
    rtn_err = _output_error(X, W, fp8.dequantize(codes, scale))
    res = gptq_quantize(W, H, FP8Grid(per_channel=True))
    assert res.q.dtype == torch.float8_e4m3fn
    assert _output_error(X, W, res.dequantize()) < rtn_err


def test_dead_inputs_do_not_break_the_inverse(layer):
    X, W, _ = layer
    X = X.clone()
    X[:, 5] = 0.0
    H = 2 * X.t() @ X / X.shape[0]
    res = gptq_quantize(W, H, IntGrid(4, True, 32))
    assert not res.fallback and torch.isfinite(res.dequantize()).all()


@pytest.mark.parametrize("n", [5, 96, 97, 300])
def test_lower_triangular_inverse(n):
    torch.manual_seed(n)
    L = torch.tril(torch.randn(n, n, dtype=torch.float64)) / n ** 0.5 + 2 * torch.eye(n, dtype=torch.float64)
    inv = lower_triangular_inverse(L, base=32)
    assert torch.equal(inv, torch.tril(inv))
    assert torch.allclose(inv @ L, torch.eye(n, dtype=torch.float64), atol=1e-12)


def test_inverse_hessian_factor_is_the_cholesky_factor_of_the_inverse(layer):
    """U upper triangular with U^T U = (H + damp)^-1: float32 result against float64
    (relative error of float32 arithmetic on a matrix with condition number ~1e4)."""
    _, _, H = layer
    upper, used = inverse_hessian_cholesky(H, 0.01)
    damped = H.double() + used * H.double().diagonal().mean() * torch.eye(H.shape[0])
    reference = torch.linalg.cholesky(torch.linalg.inv(damped), upper=True)
    assert used == 0.01 and torch.equal(upper, torch.triu(upper))
    assert ((upper.double() - reference).norm() / reference.norm()).item() < 1e-4


def test_cholesky_failure_raises_dampening_then_succeeds():
    H = torch.diag(torch.tensor([1.0, 1.0, 1.0, -0.05]))  # slightly indefinite
    upper, used = inverse_hessian_cholesky(H, 0.01)
    assert upper is not None and used == pytest.approx(0.1)  # 1% failed, 10% worked


def test_cholesky_failure_falls_back_to_round_to_nearest():
    torch.manual_seed(0)
    W = torch.randn(8, 16)
    H = -torch.eye(16)  # no dampening makes this positive definite
    grid = IntGrid(4, True, -1)
    res = gptq_quantize(W, H, grid)
    assert res.fallback and res.dampening is None
    q, _, _ = rtn.rtn_quantize(W, grid)
    assert torch.equal(res.q, q)
