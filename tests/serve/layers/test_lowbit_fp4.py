"""E2M1 codebook codes (MXFP4 read in place) on every low-bit kernel path, per
instruction-set variant this CPU runs (``isa``): csrc/lowbit_gemm.cpp's AVX512-BF16 body
(vpermw lookup) and its scalar path, csrc/lowbit_avx2.cpp (vpshufb lookup, codes offset
by 12), against float64 products with :meth:`AffineCodes.dequantize`, which
tests/quant/test_mxfp4.py holds to transformers' decoding."""

from __future__ import annotations

import pytest
import torch

from llmctl.quant import mxfp4
from llmctl.serve.kernels.cpu import selected_variant
from llmctl.serve.layers.lowbit import (
    AffineCodes,
    LowBitLinear,
    avx2_available,
    avx2_fits,
    e8m0,
    kernel_fits,
    simd_available,
    vnni_fits,
)
from tests.serve.layers.test_lowbit_avx2 import AVX2_QMAX, _activations, _reference

# E8M0 exponents spanning the range: 0 and 1 make float32 subnormal scales (2^-128,
# 2^-127), 240 (2^112) the largest whose outputs stay finite at these sizes; 255 (NaN in
# the MX spec) decodes to 2^127 and outputs overflow to inf, as in transformers' decode
EXTREMES = (0, 1, 2, 60, 118, 121, 124, 127, 128, 131, 200, 240)


def _fp4_codes(n: int, k: int, seed: int) -> AffineCodes:
    """Random E2M1 codes, each of the 16 in every row, and a spread of scales: each row
    one of :data:`EXTREMES`, its groups up to 3 above it (an output's tolerance is
    relative to its own size, so tiny rows are tested as tiny rows)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    q[:, :16] = torch.arange(16, dtype=torch.uint8)
    base = torch.tensor(EXTREMES, dtype=torch.int32).repeat(n // len(EXTREMES) + 1)[:n]
    e8m0 = (base.unsqueeze(1) + torch.randint(0, 4, (n, k // 32), generator=gen,
                                              dtype=torch.int32)).clamp(max=240)
    return AffineCodes(q, mxfp4.half_scales(e8m0.to(torch.uint8)), None, 32, 4,
                       mxfp4.FP4_TIMES_2)


def _path(layer: LowBitLinear) -> str:
    if layer.portable or not (simd_available() or layer.avx2):
        return "scalar"
    return "avx2" if layer.avx2 else "avx512-bf16"


def test_the_codebook_fits_every_kernel_but_the_vnni_copy():
    codes = _fp4_codes(16, 64, seed=0)
    assert kernel_fits(codes) and avx2_fits(codes) and not vnni_fits(codes)
    # only the kernels' own table, without offsets
    other = AffineCodes(codes.q, codes.scale, None, 32, 4, tuple(range(16)))
    shifted = AffineCodes(codes.q, codes.scale, torch.zeros_like(codes.scale), 32, 4,
                          mxfp4.FP4_TIMES_2)
    assert not any(f(c) for f in (kernel_fits, avx2_fits) for c in (other, shifted))
    assert AffineCodes.cat([codes, AffineCodes(codes.q, codes.scale, None, 32, 4)]) is None


@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
@pytest.mark.parametrize("n,k", [(40, 256), (96, 128), (33, 512)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17])
def test_fp4_layer_is_the_decoded_product(isa, portable, n, k, rows):
    """bfloat16 activations; float64 reference on the decoded weights. The AVX512-BF16
    body and the scalar path multiply exactly (bf16 times integers up to 12) and sum in
    float32: within 1e-5 of the sum of |products| (plus 2^-140: subnormal outputs of the
    2^-128 scales round to float32's 2^-149 grid). The AVX2 body rounds each block of 32
    activations to 16-bit levels (exact against that rounding, float32 sums aside, and
    within the rounding's own bound of the product with x)."""
    codes = _fp4_codes(n, k, seed=rows + n)
    x = _activations(rows, k, seed=rows).bfloat16()
    layer = LowBitLinear(codes, out_float=True, portable=portable)
    assert layer.kind == "fp4" and layer.zeros is None and layer.vnni_codes is None
    path = _path(layer)
    assert path == ("scalar" if portable else
                    "avx512-bf16" if simd_available() else
                    "avx2" if avx2_available() else "scalar"), selected_variant()
    got = layer(x).double()
    w = codes.dequantize(torch.float64)
    exact = x.double() @ w.T
    size = x.double().abs() @ w.abs().T
    if path == "avx2":
        want, bound = _reference(codes, x, AVX2_QMAX)
        assert ((got - want).abs() <= 1e-5 * size + 2.0 ** -140).all()
        assert ((got - exact).abs() <= bound + 1e-5 * size + 2.0 ** -140).all()
    else:
        assert ((got - exact).abs() <= 1e-5 * size + 2.0 ** -140).all()
    # the bf16 output is the float32 one rounded; float32-subnormal outputs (the 2^-128
    # scales' rows) may be flushed to 0 (vcvtneps2bf16 treats denormals as zero)
    bf16 = LowBitLinear(codes, portable=portable)(x)
    rounded = got.float().bfloat16()
    normal = got.abs() >= torch.finfo(torch.float32).tiny
    assert torch.equal(bf16[normal], rounded[normal])
    assert ((bf16 == rounded) | (bf16 == 0))[~normal].all()


def test_every_code_and_scale_alone(isa):
    """One code per output row (all 16, each under each extreme scale) times a row of
    ones: the kernels' table entry times the scale, exactly (float32 holds every such
    product; a row of 32 equal terms sums exactly too)."""
    e8m0 = torch.tensor(EXTREMES, dtype=torch.uint8)
    q = torch.arange(16, dtype=torch.uint8).repeat_interleave(len(EXTREMES))
    q = q.unsqueeze(1).expand(-1, 32).contiguous()
    scale = mxfp4.half_scales(e8m0.repeat(16)).unsqueeze(1)
    codes = AffineCodes(q, scale, None, 32, 4, mxfp4.FP4_TIMES_2)
    x = torch.ones(1, 32, dtype=torch.bfloat16)
    want = 32 * torch.tensor(mxfp4.FP4_TIMES_2).repeat_interleave(len(EXTREMES)) * scale[:, 0]
    for portable in (False, True):
        got = LowBitLinear(codes, out_float=True, portable=portable)(x)[0]
        assert torch.equal(got, want), (portable, (got - want).abs().max())


@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
def test_a_row_does_not_depend_on_its_batch(isa, portable):
    codes = _fp4_codes(72, 128, seed=3)
    layer = LowBitLinear(codes, portable=portable)
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    full = layer(x)
    for lo, hi in ((0, 1), (4, 5), (8, 9), (1, 3), (2, 7)):
        assert torch.equal(layer(x[lo:hi]), full[lo:hi])


def test_float32_activations_on_the_avx2_kernel(isa):
    """The AVX2 body takes float32 rows as they are (no bf16 rounding first)."""
    codes = _fp4_codes(40, 256, seed=5)
    layer = LowBitLinear(codes, out_float=True)
    if not layer.avx2:
        pytest.skip(f"the {selected_variant()} build runs bf16 activations (AVX512-BF16 or "
                    "the scalar path): no float32 kernel input")
    x = _activations(3, 256, seed=7)
    want, bound = _reference(codes, x, AVX2_QMAX)
    got = layer(x).double()
    size = x.double().abs() @ codes.dequantize(torch.float64).abs().T
    assert ((got - want).abs() <= 1e-5 * size + 2.0 ** -140).all()


@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
def test_the_codebook_is_the_int8_codes_path_with_half_the_bytes(isa, portable):
    """The same MXFP4 expert as E2M1 nibbles and as the int8 codes (the path before):
    the AVX512-BF16 body and the scalar path compute the same float32 outputs bit for
    bit (the same exact products, summed in the same order); the AVX2 body sums the
    codes offset by 12 and so differs by float32 rounding only. 0.53 bytes per weight
    held (the nibbles and an E8M0 byte per 32) against 1.125."""
    gen = torch.Generator().manual_seed(4)
    blocks, scales = mxfp4.quantize(torch.randn(96, 256, generator=gen) * 0.02)
    fp4 = LowBitLinear(AffineCodes(*mxfp4.nibble_codes(blocks, scales), None, 32, 4,
                                   mxfp4.FP4_TIMES_2), out_float=True, portable=portable,
                       vnni_copy=False)
    int8 = LowBitLinear(AffineCodes(*mxfp4.int8_codes(blocks, scales), None, 32, 8),
                        out_float=True, portable=portable, vnni_copy=False)
    assert fp4.nbytes == (0.5 + 1 / 32) * 96 * 256 and int8.nbytes == 1.125 * 96 * 256
    for rows in (1, 2, 5):
        x = torch.randn(rows, 256, generator=gen).bfloat16()
        if fp4.avx2:
            want = int8(x)
            torch.testing.assert_close(fp4(x), want, rtol=0, atol=1e-6 * want.abs().max().item())
        else:
            assert torch.equal(fp4(x), int8(x))


def test_the_scales_are_held_as_e8m0_bytes():
    """Every E8M0 byte survives the float32 scale and back (frexp: 2^-128 and 2^-127,
    float32 subnormals, too); a scale that is no such power of two does not fit."""
    e = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(e8m0(mxfp4.half_scales(e)), e)
    codes = _fp4_codes(16, 64, seed=1)
    assert e8m0(codes.scale * 3) is None
    assert not kernel_fits(AffineCodes(codes.q, codes.scale * 3, None, 32, 4, mxfp4.FP4_TIMES_2))
    layer = LowBitLinear(codes)
    assert layer.scales.dtype == torch.uint8 and layer.scales.shape[1] == 64 // 32
