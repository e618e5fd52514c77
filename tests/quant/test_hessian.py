"""The Hessian accumulator: upper-triangle strips add up to 2/n X^T X."""

from itertools import pairwise

import pytest
import torch

from llmctl.quant.hessian import HessianAccumulator, add_upper_gram, mirror_upper, strips


@pytest.mark.parametrize("cols,width", [(576, 384), (1536, 384), (577, 384), (7, 384), (1000, 128)])
def test_strips_cover_every_column_once(cols, width):
    parts = strips(cols, width)
    assert parts[0][0] == 0 and parts[-1][1] == cols
    assert all(a == b for (_, a), (b, _) in pairwise(parts))
    assert all(0 < b - a <= width for a, b in parts)


def test_upper_gram_matches_full_product():
    torch.manual_seed(0)
    x = torch.randn(300, 40, dtype=torch.float64)
    upper = torch.zeros(40, 40, dtype=torch.float64)
    for a, b in strips(40, 16):  # three strips of 14/14/12 columns
        upper[a:b, a:].addmm_(x[:, a:b].t(), x[:, a:])
    H = mirror_upper(upper)
    assert torch.equal(H, H.t())
    assert torch.allclose(H, x.t() @ x, rtol=1e-12)  # float64: only rounding differs


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_accumulator_over_chunks_is_two_x_transpose_x_over_n(dtype, rtol):
    """bf16 inputs: the products are rounded to bf16 per chunk of LOWP_ROWS rows (the
    accumulator's documented trade-off), so the tolerance is bf16's."""
    torch.manual_seed(1)
    x = torch.randn(2500, 450) * torch.linspace(0.5, 3.0, 450)
    acc = HessianAccumulator(450)
    for chunk in x.to(dtype).split(700):
        acc.add(chunk.reshape(-1, 100, 450))  # (sequences, tokens, features)
    ref = 2 * x.to(dtype).double().t() @ x.to(dtype).double() / x.shape[0]
    H = acc.hessian()
    assert acc.count == 2500 and torch.equal(H, H.t())
    assert torch.allclose(H.double(), ref, rtol=rtol, atol=rtol * ref.diagonal().mean().item())


def test_upper_gram_equals_one_matmul_entrywise():
    """Each strip computes the same dot products as the full matmul (MKL gives the same
    bits; allow float32 rounding in case another BLAS tiles differently)."""
    torch.manual_seed(2)
    x = torch.randn(4096, 576)
    upper = torch.zeros(576, 576)
    add_upper_gram(upper, x)
    full = x.t() @ x
    assert torch.allclose(mirror_upper(upper), full, rtol=1e-5, atol=1e-3)
