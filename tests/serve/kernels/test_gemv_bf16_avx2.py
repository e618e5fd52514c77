"""csrc/gemv_bf16_avx2.cpp (bf16 weights widened to float32 in registers, AVX2 + FMA)
against a float64 reference of the same bf16 weights and inputs, and the layer that
runs it (:class:`llmctl.serve.layers.quant_linear.WideningBF16Linear`) at small and large
batches, in every instruction-set variant this CPU runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmctl.serve.kernels import cpu as cpu_kernels
from llmctl.serve.layers.quant_linear import (
    DenseLinear,
    WideningBF16Linear,
    dense_linear,
    packing_available,
)
from llmctl.utils.cpu import cpu_flags
from tests.serve.paged_cases import needs_kernels

EPS32 = 2.0 ** -24  # float32's unit roundoff


def _sum_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Float32 summation error of the kernel's order: each of a vector's 8 lanes takes k/8
    products by FMA (one rounding each), then 3 rounds of lane sums, so (Higham's gamma_n)
    |err| <= (k/8 + 3) u / (1 - n u) * sum_k |x w|; (k/8 + 4) u covers the denominator.
    The products of bf16 weights with float32 or bf16 inputs are exact in the FMA."""
    k = x.shape[1]
    return (k / 8 + 4) * EPS32 * (x.double().abs() @ w.double().abs().T)


def _bf16_step(v: torch.Tensor) -> torch.Tensor:
    """One bf16 step (8 significant bits) at v's magnitude."""
    return 2.0 ** (torch.floor(torch.log2(v.abs().clamp_min(1e-30))) - 7)


def _run(fn, x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    rows, n = x.shape[0], w.shape[0]
    out = torch.full((rows, n), float("nan"), dtype=out_dtype)
    fn(x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16), w.data_ptr(), rows, n,
       w.shape[1], out.data_ptr(), out.stride(0), int(out_dtype == torch.bfloat16),
       torch.get_num_threads())
    return out


@needs_kernels
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(37, 61), (40, 96), (9, 5), (19, 1000)])
def test_kernel_is_the_float64_product_up_to_float32_summation(n, k, x_dtype, isa):
    """Rows 1..9 (every row tile: 1-4 rows, then 4 + 1..4 more), n not a multiple of the
    8-column unit, k not a multiple of 8 or 16 (the zero-padded tail chunk); x strided
    (ldx > k) and the output strided too."""
    fn = cpu_kernels.gemm_bf16w_avx2_kernel()
    if fn is None:
        pytest.skip(f"the {isa} build has no AVX2 + FMA kernel")
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn((n, k), generator=gen).bfloat16()
    for rows in range(1, 10):
        x = torch.randn((rows, k + 3), generator=gen).to(x_dtype)[:, :k]  # ldx = k + 3
        exact = x.double() @ w.double().T
        got = _run(fn, x, w, torch.float32)
        assert ((got.double() - exact).abs() <= _sum_bound(x, w)).all(), (rows, n, k)
        # bf16 output: the float32 sum rounded once to nearest even, so within half a bf16
        # step of the float32 sum: within one step of the exact product
        got16 = _run(fn, x, w, torch.bfloat16)
        assert torch.equal(got16, got.bfloat16()), (rows, n, k)
        assert ((got16.double() - exact).abs() <= _bf16_step(exact) + _sum_bound(x, w)).all()
    # a wider output buffer: ldo > n, the columns past n untouched
    x = torch.randn((3, k), generator=gen).to(x_dtype)
    wide = torch.full((3, n + 5), 7.0)
    fn(x.data_ptr(), k, int(x_dtype == torch.bfloat16), w.data_ptr(), 3, n, k,
       wide.data_ptr(), n + 5, 0, 1)
    assert (wide[:, n:] == 7.0).all()
    assert ((wide[:, :n].double() - x.double() @ w.double().T).abs() <= _sum_bound(x, w)).all()


@needs_kernels
def test_dense_linear_picks_the_widening_layer_where_onednn_cannot_pack_bf16(isa):
    """The portable build has no kernel: bf16 stays on the torch layer. An AVX2 or native
    build on a CPU with AVX2 + FMA takes the widening layer wherever oneDNN would not pack
    the bf16 weight (an AVX-512 CPU keeps oneDNN's packed layer)."""
    w = torch.randn((24, 40)).bfloat16()
    fn = cpu_kernels.gemm_bf16w_avx2_kernel()
    layer = dense_linear(w, None)
    if isa == "portable":
        assert fn is None and not isinstance(layer, WideningBF16Linear)
        if not packing_available(torch.bfloat16, w.device):
            assert isinstance(layer, DenseLinear)
        return
    if {"avx2", "fma"} <= cpu_flags():
        assert fn is not None
    if fn is not None and not packing_available(torch.bfloat16, w.device):
        assert isinstance(layer, WideningBF16Linear)
        assert layer.kind == "dense" and layer.out_features == 24
        assert layer.nbytes == w.numel() * 2 and layer.weight.data_ptr() == w.data_ptr()
    assert not isinstance(dense_linear(w.float(), None), WideningBF16Linear)


@needs_kernels
@pytest.mark.parametrize("with_bias", [False, True])
def test_widening_layer_matches_float64_at_small_and_large_batches(with_bias, monkeypatch):
    """Kernel rows (up to KERNEL_MAX_ROWS) and F.linear rows (more) alike: float32 sums of
    the exact products, the bias added in float32, one rounding to bf16, so within one
    bf16 step (plus the float32 summation bound) of the float64 product; float32 inputs
    come back float32 within the summation bound; 3-D inputs flatten."""
    fn = cpu_kernels.gemm_bf16w_avx2_kernel()
    if fn is None:
        pytest.skip("this build has no AVX2 + FMA kernel")
    gen = torch.Generator().manual_seed(11)
    n, k = 45, 200
    w = torch.randn((n, k), generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    layer = WideningBF16Linear(w, b, fn)
    top = WideningBF16Linear.KERNEL_MAX_ROWS
    for rows in (1, 2, 5, top, top + 1, 64):
        x = torch.randn((rows, k), generator=gen).bfloat16()
        exact = F.linear(x.double(), w.double(), None if b is None else b.double())
        bound = _sum_bound(x, w) + (0 if b is None else EPS32 * exact.abs())
        got = layer(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        assert ((got.double() - exact).abs() <= _bf16_step(exact) + bound).all(), rows
        x32 = torch.randn((rows, k), generator=gen)
        exact32 = F.linear(x32.double(), w.double(), None if b is None else b.double())
        got32 = layer(x32)
        assert got32.dtype == torch.float32
        assert ((got32.double() - exact32).abs()
                <= _sum_bound(x32, w) + (0 if b is None else 2 * EPS32 * exact32.abs())).all()
    x3 = torch.randn((2, 3, k), generator=gen).bfloat16()
    assert torch.equal(layer(x3), layer(x3.reshape(6, k)).view(2, 3, n))
    # a batch of 0 rows (an empty step) and a strided input
    assert layer(torch.empty((0, k), dtype=torch.bfloat16)).shape == (0, n)
    xs = torch.randn((4, 2 * k), generator=gen).bfloat16()[:, ::2]
    assert torch.equal(layer(xs), layer(xs.contiguous()))
