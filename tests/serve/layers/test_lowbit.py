"""The own int4/int8 kernels (csrc/lowbit_gemm.cpp, csrc/lowbit_vnni.cpp for one to four
rows) and what runs on them: compressed-tensors layers, the int8 lm_head, and GGUF
Q4_0/Q4_1/Q8_0 tensors served without a float copy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from llmctl.serve.engine.llm import LLM
from llmctl.serve.kernels.cpu import lowbit_kernel, lowbit_vnni_kernel
from llmctl.serve.layers import quant_linear
from llmctl.serve.layers.lowbit import (
    AffineCodes,
    LowBitLinear,
    avx2_available,
    quantize_int8,
    simd_available,
    vnni_fits,
)
from llmctl.serve.layers.quant_linear import QuantWeight, make_linear
from llmctl.serve.model.gguf_weights import CODECS, decode_blocks
from llmctl.utils.cpu import cpu_flags
from tests.serve.conftest import PROMPTS, encode
from tests.serve.model.test_model import engine_logits

CPU = torch.device("cpu")
PATHS = [False, True]  # portable (scalar reference) path off / on


def _codes(bits: int, n: int, k: int, group: int, zero: bool, seed: int) -> AffineCodes:
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    z = torch.randn(n, k // group, generator=gen) * 0.05 if zero else None
    return AffineCodes(q, scale, z, group, bits)


def test_the_kernel_is_built_with_avx512_bf16_where_the_cpu_has_it():
    """A CPU with AVX512-BF16 must get the fast path: a broken build fails here instead
    of silently serving on torch's slower kernels."""
    assert lowbit_kernel() is not None, "the native kernels did not build"
    assert simd_available() == ("avx512_bf16" in cpu_flags())
    assert (lowbit_vnni_kernel() is not None) == ("avx512_vnni" in cpu_flags())


@pytest.mark.parametrize("portable", PATHS, ids=["simd", "portable"])
@pytest.mark.parametrize("bits,n,k,group,zero", [
    (4, 40, 192, 64, True),     # output rows not a multiple of 16
    (4, 96, 128, 32, True),     # GGUF-sized groups
    (4, 64, 256, 256, True),    # one group per row (per channel)
    (8, 48, 64, 32, False),     # Q8_0-like
    (8, 40, 192, 192, True),    # asymmetric per channel
])
@pytest.mark.parametrize("rows", [1, 2, 3, 9, 17, 64])
def test_kernel_matches_float32_reference(portable, bits, n, k, group, zero, rows):
    codes = _codes(bits, n, k, group, zero, seed=rows + n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    want = x.float() @ codes.dequantize().T
    # vnni=False: one to four rows stay on this kernel (the VNNI one is tested below)
    got = LowBitLinear(codes, out_float=True, portable=portable, vnni=False)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    # the products are exact (bf16 x small integers in float32): only the float32
    # summation order differs from the reference, ~1e-6 of the output's scale
    torch.testing.assert_close(got, want, atol=2e-5 * want.abs().max().item(), rtol=1e-5)
    bf16 = LowBitLinear(codes, portable=portable, vnni=False)(x)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), got.bfloat16().float(), atol=0, rtol=0)


@pytest.mark.parametrize("portable", PATHS, ids=["simd", "portable"])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_does_not_depend_on_its_batch(portable, bits):
    """Each row's sums run in the same order at any batch size: a request's tokens do
    not change with the company it is batched with (bit for bit)."""
    codes = _codes(bits, 64, 128, 32, True, seed=bits)
    layer = LowBitLinear(codes, portable=portable, vnni=False)
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    full = layer(x)
    for i in (0, 1, 7, 63):
        assert torch.equal(layer(x[i:i + 1]), full[i:i + 1])
    assert torch.equal(layer(x[5:8]), full[5:8])


def _vnni_reference(codes: AffineCodes, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VNNI kernel's product in float64 (dequantized weights times the activations
    rounded to 15 bits per block of 32, as csrc/lowbit_vnni.cpp rounds them), and the
    bound on its distance from the product with x itself: half a step per input."""
    rows, k = x.shape
    blocks = x.float().view(rows, -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(16383.0) / amax, torch.zeros_like(amax))
    step = (amax / 16383.0).double()
    xq = (torch.round(blocks * inv).double() * step).view(rows, k)
    w = codes.dequantize(torch.float64)
    bound = (step / 2).expand(-1, -1, 32).reshape(rows, k) @ w.abs().T
    return xq @ w.T, bound


@pytest.mark.skipif(lowbit_vnni_kernel() is None, reason="this CPU has no AVX512-VNNI")
@pytest.mark.parametrize("bits,n,k,group,zero", [
    (4, 40, 192, 64, True),     # output rows not a multiple of 32 (pairs of blocks)
    (4, 96, 128, 32, True),     # GGUF-sized groups
    (4, 64, 256, 256, False),   # per channel, symmetric
    (8, 48, 64, 32, False),     # Q8_0-like
    (8, 40, 192, 192, True),    # asymmetric per channel
])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])  # 5-8: a second pass over the codes
def test_vnni_kernel_is_exact_on_15_bit_activations(bits, n, k, group, zero, rows):
    """One to eight rows run on byte products of 15-bit activations: exact against the
    same rounding done here in float64 (float32 sums aside), and within the rounding's
    own bound of the product with the bfloat16 activations themselves."""
    codes = _codes(bits, n, k, group, zero, seed=rows + n)
    gen = torch.Generator().manual_seed(rows)
    # heavy-tailed activations, a zero block and a block of one outlier among tiny values
    x = (torch.randn(rows, k, generator=gen) * torch.randn(rows, k, generator=gen).exp())
    x[0, :32] = 0
    x[-1, 32:64] = 1e-3
    x[-1, 40] = 50.0
    x = x.bfloat16()
    layer = LowBitLinear(codes, out_float=True)
    assert vnni_fits(codes) and layer.vnni_rows >= rows
    got = layer(x).double()
    want, bound = _vnni_reference(codes, x)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, atol=2e-6 * scale, rtol=1e-5)
    exact = x.double() @ codes.dequantize(torch.float64).T
    assert ((got - exact).abs() <= bound + 2e-6 * scale).all()
    # the bfloat16 output is the float32 one rounded, and a row's result is the same at
    # any row count this kernel takes (integer sums, then one order of float ones)
    assert torch.equal(LowBitLinear(codes)(x).float(), got.float().bfloat16().float())
    for i in range(rows):
        assert torch.equal(layer(x[i:i + 1]), got.float()[i:i + 1])


def test_layers_the_vnni_kernel_cannot_take_stay_on_the_bfloat16_one():
    """Groups that are not whole 32-input blocks keep one to four rows on the first
    kernel (no second copy of the codes)."""
    codes = _codes(4, 32, 96, 48, True, seed=3)
    assert not vnni_fits(codes)
    layer = LowBitLinear(codes, out_float=True)
    assert layer.vnni_rows == 0
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(0)).bfloat16()
    want = x.float() @ codes.dequantize().T
    torch.testing.assert_close(layer(x), want, atol=2e-5 * want.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("bits,zero", [(4, False), (4, True), (8, False), (8, True)])
def test_checkpoint_codes_become_the_same_weights(bits, zero):
    gen = torch.Generator().manual_seed(bits)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1)
    q = torch.randint(lo, hi, (32, 64), generator=gen, dtype=torch.int8)
    scale = torch.rand(32, 2, generator=gen) + 0.1
    zp = torch.randint(lo, hi, (32, 2), generator=gen, dtype=torch.int8) if zero else None
    weight = QuantWeight(q=q, scale=scale, zero_point=zp, group_size=32, num_bits=bits)
    want = weight.dequantize(torch.float32)
    # s q - s zp against s (q - zp): two float32 roundings of terms up to 2^bits s
    torch.testing.assert_close(weight.affine().dequantize(), want,
                               atol=2e-6 * want.abs().max().item(), rtol=1e-6)


def test_make_linear_picks_the_own_kernel_and_keeps_torch_kernels_without_it(monkeypatch):
    q = torch.randint(-8, 8, (40, 192), generator=torch.Generator().manual_seed(0),
                      dtype=torch.int8)
    weight = QuantWeight(q=q, scale=torch.rand(40, 3) + 0.1, zero_point=None, group_size=64,
                         num_bits=4)
    kwargs = dict(dtype=torch.float32, device=CPU, backend="kernel")
    if simd_available() or avx2_available():
        assert isinstance(make_linear(weight, None, **kwargs), LowBitLinear)
    monkeypatch.setattr(quant_linear, "simd_available", lambda: False)
    monkeypatch.setattr(quant_linear, "avx2_available", lambda: False)
    assert isinstance(make_linear(weight, None, **kwargs), quant_linear.Int4Linear)


def test_int8_quantization_round_trips_within_half_a_step():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(2))
    codes = quantize_int8(w, 32)
    step = codes.scale.repeat_interleave(32, dim=1)
    assert ((codes.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    assert codes.q.abs().max() <= 127


# --- GGUF blocks ------------------------------------------------------------------------
@pytest.mark.parametrize("type_name", sorted(CODECS))
def test_gguf_blocks_decode_to_ggufs_own_dequantization(type_name):
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    data = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    raw = gguf.quants.quantize(data, qtype)
    codes = decode_blocks(raw, type_name, 24, 96)
    want = gguf.quants.dequantize(raw, qtype).reshape(24, 96)
    np.testing.assert_allclose(codes.dequantize().numpy(), want, rtol=1e-6, atol=1e-7)


def _gguf(tiny: Path, tmp_path: Path, out_type: str) -> Path:
    from llmctl.gguf.writer import export_gguf

    return export_gguf(tiny, tmp_path / f"{tiny.name}-{out_type}.gguf", out_type)


@pytest.mark.parametrize("out_type", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gguf_served_quantized_matches_its_float_import(tiny_llama, tiny_llama_tied, tmp_path,
                                                        out_type, tied):
    path = _gguf(tiny_llama_tied if tied else tiny_llama, tmp_path, out_type)
    native = LLM(str(path), kv_cache_memory="4MiB")  # a .gguf path: quantized by default
    model = native.engine.target.model
    kinds = quant_linear.describe({f"{i}.{n}": getattr(layer, n)
                                   for i, layer in enumerate(model.layers)
                                   for n in ("qkv", "o", "gate_up", "down")})
    fast = simd_available() or avx2_available()  # groups of 32: both kernels take them
    want_kind = ("int8" if out_type == "Q8_0" else "int4") if fast else "dense"
    assert kinds == {want_kind: 4 * len(model.layers)}
    assert isinstance(model.lm_head, LowBitLinear) == fast
    ref = LLM(str(path), kv_cache_memory="4MiB", gguf_weights="float")
    assert not isinstance(ref.engine.target.model.layers[0].qkv, LowBitLinear)
    ids = encode(ref.engine.target.path, PROMPTS[3])
    got, want = engine_logits(native, ids, 9), engine_logits(ref, ids, 9)
    # same weights; the quantized path rounds activations to bfloat16 (~3 significant
    # digits per matmul, the bound of the compressed-tensors int4/int8 test)
    torch.testing.assert_close(got, want, atol=0.25, rtol=0.02)


def test_int8_lm_head_option(tiny_llama_tied):
    plain = LLM(str(tiny_llama_tied), kv_cache_memory="4MiB")
    int8 = LLM(str(tiny_llama_tied), kv_cache_memory="4MiB", lm_head="int8")
    head = int8.engine.target.model.lm_head
    assert isinstance(head, LowBitLinear) and head.bits == 8 and head.group_size == 32
    ids = encode(tiny_llama_tied, PROMPTS[1])
    got, want = engine_logits(int8, ids, 5), engine_logits(plain, ids, 5)
    # int8 codes (half a step of error per weight) and bfloat16 activations
    torch.testing.assert_close(got, want, atol=0.25, rtol=0.02)


@pytest.mark.slow
def test_smollm2_gguf_quantized_log_probs_match_its_float32_weights(smollm2):
    """The embedded Q4_1 GGUF on the kernel in bf16, against the same weights dequantized
    to float32 (both through the engine): only activation rounding may differ, so the
    bf16-vs-float32 bound of test_cpu_kernels applies."""
    from llmctl.serve.core.sampling_params import SamplingParams
    from tests.serve.kernels.test_cpu_kernels import BF16_MEAN_ABS_LOGPROB

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    prompts = [encode(smollm2, p) for p in PROMPTS]

    def logprobs(**kwargs) -> list[float]:
        llm = LLM("smollm2-135m", kv_cache_memory="64MiB", max_model_len=256, **kwargs)
        outs = llm.generate(prompts, params)
        return [e.logprob for o in outs for e in o.prompt_logprobs[1:]]

    native = logprobs(dtype="bfloat16", gguf_weights="quantized")
    ref = logprobs(dtype="float32", gguf_weights="float")
    errors = [abs(a - b) for a, b in zip(native, ref)]
    assert len(errors) == len(ref) > 30
    assert sum(errors) / len(errors) <= BF16_MEAN_ABS_LOGPROB
