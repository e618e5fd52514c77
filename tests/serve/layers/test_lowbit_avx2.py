"""The AVX2 + FMA low-bit kernel (csrc/lowbit_avx2.cpp) against the float reference, per
instruction-set variant this CPU runs, and LowBitLinear on whichever kernel the variant
gives it (the scalar reference path where it has no SIMD one)."""

from __future__ import annotations

import pytest
import torch

from llmctl.serve.kernels.cpu import lowbit_avx2_kernel, selected_variant
from llmctl.serve.layers import quant_linear
from llmctl.serve.layers.lowbit import (
    AffineCodes,
    LowBitLinear,
    avx2_available,
    avx2_fits,
    fast_fits,
    pack_avx2,
    simd_available,
)
from llmctl.serve.layers.quant_linear import QuantWeight, make_linear
from llmctl.utils.cpu import cpu_flags

AVX2_QMAX = 32767.0  # the kernel's activation levels per 32-input block (16 bits)
VNNI_QMAX = 16383.0  # lowbit_vnni.cpp's (15 bits), for layers that run there

CASES = [  # bits, n, k, group, offsets
    (4, 40, 192, 64, True),     # n not a multiple of 32: a padded block, a partial sub-block
    (4, 96, 128, 32, True),     # GGUF-sized groups
    (4, 72, 256, 128, False),   # symmetric
    (4, 33, 256, 256, True),    # per channel; one valid column in the last block
    (8, 48, 64, 32, False),     # Q8_0-like
    (8, 40, 192, 64, True),
    (8, 24, 256, 128, False),   # fewer columns than one block
    (8, 40, 192, 192, True),    # asymmetric per channel
]


def _codes(bits: int, n: int, k: int, group: int, zero: bool, seed: int) -> AffineCodes:
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    else:  # the full int8 range: -128 too
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    z = torch.randn(n, k // group, generator=gen) * 0.05 if zero else None
    return AffineCodes(q, scale, z, group, bits)


def _activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """Heavy-tailed rows, a zero block, and a block of one outlier among tiny values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.randn(rows, k, generator=gen).exp()
    x[0, :32] = 0
    x[-1, 32:64] = 1e-3
    x[-1, 40] = 50.0
    return x


def _reference(codes: AffineCodes, x: torch.Tensor,
               qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The product of the dequantized weights with the activations rounded to ``qmax``
    levels per block of 32 as the kernels round them (float64), and the rounding's bound
    on the distance from the product with ``x`` itself: half a step per input."""
    rows, k = x.shape
    blocks = x.float().view(rows, -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(qmax) / amax, torch.zeros_like(amax))
    step = (amax / qmax).double()
    xq = (torch.round(blocks * inv).double() * step).view(rows, k)
    w = codes.dequantize(torch.float64)
    bound = (step / 2).expand(-1, -1, 32).reshape(rows, k) @ w.abs().T
    return xq @ w.T, bound


def _kernel(codes: AffineCodes, x: torch.Tensor, out_f32: bool = True) -> torch.Tensor:
    """One call of lowbit_gemv_avx2 on ``x`` (float32 or bf16 rows)."""
    fn, _ = lowbit_avx2_kernel()
    packed, scales, zeros = pack_avx2(codes)
    n, k = codes.shape
    out = torch.empty(x.shape[0], n, dtype=torch.float32 if out_f32 else torch.bfloat16)
    fn(x.data_ptr(), x.stride(0), int(x.dtype == torch.float32), packed.data_ptr(), codes.bits,
       scales.data_ptr(), None if zeros is None else zeros.data_ptr(), x.shape[0],
       scales.shape[0], k, codes.group_size, out.data_ptr(), n, n, int(out_f32),
       torch.get_num_threads())
    return out


def _needs_kernel():
    if lowbit_avx2_kernel() is None:
        pytest.skip(f"the {selected_variant()} kernels have no AVX2 body")


def test_the_kernel_is_built_exactly_where_the_variant_has_avx2_and_fma(isa):
    """The portable build must lack it (its callers fall back), and every build for a
    CPU with AVX2 + FMA must have it: a broken build fails here instead of serving on
    torch's slower kernels."""
    want = isa != "portable" and {"avx2", "fma"} <= cpu_flags()
    assert (lowbit_avx2_kernel() is not None) == want == avx2_available()


@pytest.mark.parametrize("bits,n,k,group,zero", CASES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11])  # 5-8, 11: tiles of 4, then more
def test_kernel_is_exact_on_16_bit_activations(isa, bits, n, k, group, zero, rows):
    """Exact against the same 16-bit rounding done here in float64 (float32 sums aside:
    2e-6 of the output's scale), and within that rounding's own bound of the product
    with the float32 or bfloat16 activations themselves."""
    _needs_kernel()
    codes = _codes(bits, n, k, group, zero, seed=rows + n)
    assert avx2_fits(codes)
    for dtype in (torch.float32, torch.bfloat16):
        x = _activations(rows, k, seed=rows).to(dtype)
        got = _kernel(codes, x).double()
        want, bound = _reference(codes, x, AVX2_QMAX)
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, atol=2e-6 * scale, rtol=1e-5)
        exact = x.double() @ codes.dequantize(torch.float64).T
        assert ((got - exact).abs() <= bound + 2e-6 * scale).all()
        # the bfloat16 output is the float32 one rounded to nearest even
        assert torch.equal(_kernel(codes, x, out_f32=False), got.float().bfloat16())


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_does_not_depend_on_its_batch(isa, bits):
    """Integer block sums, then one order of float ones whatever the tile: a request's
    tokens do not change with the company it is batched with (bit for bit)."""
    _needs_kernel()
    codes = _codes(bits, 72, 128, 32, True, seed=bits)
    x = _activations(9, 128, seed=3)
    full = _kernel(codes, x)
    for i in range(9):
        assert torch.equal(_kernel(codes, x[i:i + 1]), full[i:i + 1])
    for lo, hi in ((1, 3), (2, 5), (0, 4), (3, 9)):
        assert torch.equal(_kernel(codes, x[lo:hi]), full[lo:hi])


def test_int8_extremes_do_not_saturate(isa):
    """|q| = 128 against activations at +-32767 in every position: the largest pair
    vpmaddwd sees (2^23) and block sum (2^27), still exact in int32."""
    _needs_kernel()
    n, k = 32, 64
    q = torch.full((n, k), -128, dtype=torch.int8)
    q[1::2] = 127
    codes = AffineCodes(q, torch.ones(n, 2), None, 32, 8)
    x = torch.ones(2, k)
    x[1] = -1
    got = _kernel(codes, x)
    want = x.double() @ codes.dequantize(torch.float64).T
    torch.testing.assert_close(got.double(), want, atol=0, rtol=1e-7)


# --- LowBitLinear ---------------------------------------------------------------------
@pytest.mark.parametrize("bits,zero", [(4, True), (4, False), (8, True), (8, False)])
@pytest.mark.parametrize("rows", [1, 8, 9, 40])  # 9, 40: past the rows it is tuned for
def test_layer_matches_the_float_reference_on_every_variant(isa, bits, zero, rows):
    """On the AVX2 kernel where the variant has it and not AVX512-BF16, else on the
    others (here the scalar reference path): right results either way, in the dtype the
    activations came in, for 2-D and 3-D inputs, with a bias."""
    codes = _codes(bits, 40, 192, 64, zero, seed=rows)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(rows))
    x = _activations(rows, 192, seed=rows)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        layer = LowBitLinear(codes, bias.to(dtype))  # the model's dtype, as the engine has it
        assert layer.avx2 == (avx2_available() and not simd_available())
        xd = x.to(dtype)
        # the AVX2 kernel reads float32 and bf16 as they are (float16 as float32); the
        # other paths see bf16, which the VNNI kernel then rounds to 15 bits
        seen = xd if layer.avx2 else xd.bfloat16()
        want, bound = _reference(codes, seen.float(), AVX2_QMAX if layer.avx2 else VNNI_QMAX)
        product = seen.double() @ codes.dequantize(torch.float64).T
        exact = product + bias.to(dtype).double()
        for shape in ((rows, 192), (1, rows, 192)):
            got = layer(xd.view(shape))
            assert got.dtype == dtype and got.shape == (*shape[:-1], 40)
            err = (got.double().reshape(rows, 40) - exact).abs()
            # on top, the output's roundings: the product's (to bf16 on the other paths,
            # which return bf16 before the cast), then the sum's with the bias
            out_dtype = dtype if layer.avx2 else torch.bfloat16
            ulp = torch.finfo(out_dtype).eps * (product.abs() + exact.abs())
            assert (err <= bound + 2e-6 * want.abs().max().item() + ulp).all(), dtype


def test_out_float_returns_float32_for_bfloat16_activations(isa):
    codes = _codes(8, 48, 64, 32, False, seed=5)
    x = _activations(3, 64, seed=5).bfloat16()
    head = LowBitLinear(codes, out_float=True)
    got = head(x)
    assert got.dtype == torch.float32
    assert torch.equal(LowBitLinear(codes)(x), got.bfloat16())


def test_portable_layers_stay_on_the_scalar_path(isa):
    """``portable=True`` is the reference path on every variant: never the AVX2 kernel."""
    codes = _codes(4, 40, 192, 64, True, seed=1)
    layer = LowBitLinear(codes, portable=True)
    assert not layer.avx2
    x = _activations(2, 192, seed=1).bfloat16()
    want = x.double() @ codes.dequantize(torch.float64).T
    torch.testing.assert_close(layer(x).double(), want, atol=1e-2 * want.abs().max().item(),
                               rtol=1e-2)


@pytest.mark.parametrize("group", [64, 48])  # 48: not whole 32-input blocks
def test_make_linear_takes_the_avx2_kernel_where_it_is_the_fast_one(isa, group):
    """Without a SIMD kernel for the layer, torch's: Int4Linear (groups of 64), or the
    dequantized dense weight (48, which torch's int4 kernel does not take either)."""
    q = torch.randint(-8, 8, (40, 192), generator=torch.Generator().manual_seed(0),
                      dtype=torch.int8)
    weight = QuantWeight(q=q, scale=torch.rand(40, 192 // group) + 0.1, zero_point=None,
                         group_size=group, num_bits=4)
    layer = make_linear(weight, None, dtype=torch.float32, device=torch.device("cpu"),
                        backend="kernel")
    fast = fast_fits(weight.affine())
    assert fast == (simd_available() or (avx2_available() and group % 32 == 0))
    assert isinstance(layer, LowBitLinear) == fast
    if not fast:
        assert isinstance(layer, quant_linear.Int4Linear) == (group == 64)
    elif not simd_available():
        assert layer.avx2
