"""Quantized experts on the native low-bit kernels (issue 35): compressed-tensors int4 /
int8 experts and gpt-oss's MXFP4 experts become one ``LowBitLinear`` per expert (gate
and up joined) where the dense layers would get that kernel, instead of float copies.

The checkpoints: the tiny Qwen3-MoE quantized W4A16 (int4, groups of 32) and Mixtral
W8A16 (int8, groups of 32) by ``llmctl quantize`` round-to-nearest (the recipes of
tests/quant/test_moe_quant.py), and the tiny gpt-oss with its experts written as MXFP4
(tests/serve/model/test_gpt_oss.py). The references are transformers in float32 on the
same checkpoints (it dequantizes every layer to float32 weights); the engine runs in
float32 with ``quant_backend`` "kernel" (the default), so its low-bit layers, attention's
too in the compressed-tensors checkpoints, take bfloat16 activations into the kernel
(AVX512-BF16: exact products, float32 sums in another order, a bf16 output; AVX2:
activations quantized to 16 bits per block of 32). Hence bounds of bf16's order, not
float32's, on the logits; the exact part is checked where it is exact (the MXFP4 codes
against transformers' decoding, bit for bit). Each engine test runs on the native build
(AVX512-BF16 on an AVX-512 machine) and the AVX2 one (``isa``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmctl.quant import mxfp4
from llmctl.serve.engine.llm import LLM
from llmctl.serve.kernels import cpu as cpu_kernels
from llmctl.serve.layers.lowbit import AffineCodes, LowBitLinear, avx2_available, simd_available
from llmctl.serve.layers.quant_linear import kernel_linear
from llmctl.serve.model.scoring import teacher_forced_logits
from tests.quant.conftest import run_quantize, write_recipe
from tests.quant.test_families import _ids
from tests.quant.test_moe_quant import RECIPES, SEQ, _hf
from tests.serve.conftest import PROMPTS, encode
from tests.serve.model.test_gpt_oss import _mxfp4_checkpoint

CPU = torch.device("cpu")
# the builds whose low-bit bodies the experts run on: native (here AVX512-BF16) and AVX2
KERNEL_ISAS = [v for v in ("native", "avx2")
               if v == "native" or v in cpu_kernels.supported_variants()]
# (family, recipe) -> (bits, bytes per weight held: codes + float32 scale (+ offset) per 32)
QUANTIZED = {("qwen3_moe", "w4a16-rtn"): (4, 0.5 + 8 / 32),
             ("mixtral", "w8a16-rtn"): (8, 1 + 4 / 32)}


def _needs_lowbit_kernel() -> None:
    if not (simd_available() or avx2_available()):
        pytest.skip("no SIMD low-bit kernel in this build: the experts stay float")


@pytest.fixture(scope="module")
def quantized(tiny_family, tmp_path_factory):
    """(family, recipe) -> the quantized checkpoint's directory, built once."""
    root = tmp_path_factory.mktemp("lowbit-experts")
    built: dict = {}

    def get(name: str, recipe: str):
        if (name, recipe) not in built:
            out = root / f"{name}-{recipe}"
            run_quantize(tiny_family(name), write_recipe(root / f"{recipe}.yaml",
                                                         RECIPES[recipe]),
                         out, samples=4, seq_len=SEQ)
            built[name, recipe] = out
        return built[name, recipe]

    return get


def _model(llm: LLM):
    return llm.engine.runner.model


def _sparse(model) -> list:
    return [layer.moe for layer in model.layers if layer.moe is not None]


def _held(linear: LowBitLinear) -> int:
    """Bytes the layer holds: its codes, scales and offsets (and a VNNI copy, if any)."""
    tensors = [linear.packed, linear.scales, linear.zeros, *(linear.vnni_codes or ())]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _compare(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(largest logit error / largest |logit|, share of positions with the same top-1)."""
    rel = ((got - want).abs().max() / want.abs().max()).item()
    return rel, (got.argmax(-1) == want.argmax(-1)).float().mean().item()


def _bound(bf16: float) -> float:
    """The largest logit error, relative to the largest logit, a float32 engine may show
    against transformers: ``bf16`` where the low-bit kernel rounds activations to bf16
    (AVX512-BF16), 1e-3 on the AVX2 kernel, which takes float32 activations and quantizes
    each block of 32 to 16-bit levels (measured 2e-5 to 1.2e-4)."""
    return bf16 if simd_available() else 1e-3


# --- compressed-tensors int4 / int8 experts -------------------------------------------------
@pytest.mark.parametrize("isa", KERNEL_ISAS, indirect=True)
@pytest.mark.parametrize("name, recipe", sorted(QUANTIZED))
def test_quantized_experts_run_on_the_lowbit_kernel(quantized, isa, name, recipe):
    """Every expert one low-bit linear (gate and up joined, one copy of the codes: the
    bytes per weight of the codes and their float32 scales, not float32's 4 or bf16's 2);
    batch-1 bytes count the ``k`` active experts at those bytes; the logits near
    transformers' on the same checkpoint (:func:`_bound`: within 3 % of the largest
    logit with bf16 activations in every low-bit layer, measured 1.4 % (Qwen3-MoE int4)
    and 1.7 % (Mixtral int8) on an AVX512-BF16 Xeon) and the same top-1 token at 90 % of
    positions or more (measured 97-100 %)."""
    _needs_lowbit_kernel()
    bits, per_weight = QUANTIZED[name, recipe]
    path = quantized(name, recipe)
    llm = LLM(str(path), kv_cache_memory="4MiB", block_size=4)
    model = _model(llm)
    spec = model.spec
    for moe in _sparse(model):
        assert len(moe.gate_up) == len(moe.down) == spec.num_experts
        for gate_up, down in zip(moe.gate_up, moe.down):
            assert isinstance(gate_up, LowBitLinear) and isinstance(down, LowBitLinear)
            assert gate_up.kind == down.kind == f"int{bits}"
            assert gate_up.out_features == 2 * spec.expert_intermediate_size
            assert gate_up.avx2 == (not simd_available())  # the AVX2 build, or a Zen 3
            for linear in (gate_up, down):
                assert linear.vnni_codes is None  # one copy
                weights = linear.out_features * linear.in_features
                assert _held(linear) == linear.nbytes == per_weight * weights
        assert moe.router.dtype == torch.float32  # the router stays float
        experts = sum(linear.nbytes for linear in [*moe.gate_up, *moe.down])
        idle = experts * (spec.num_experts - spec.experts_per_token) // spec.num_experts
        assert moe.nbytes - moe.active_nbytes == idle
    ids = _ids(seed=2)[0].tolist()
    got = teacher_forced_logits(llm.engine, ids, 7)
    with torch.inference_mode():
        want = _hf(path)(torch.tensor([ids])).logits[0, 6:].float()
    rel, top1 = _compare(got, want)
    assert rel < _bound(0.03) and top1 >= 0.9, (rel, top1)


@pytest.mark.parametrize("isa, backend", [("native", "dequantize"), ("portable", "kernel")],
                         indirect=["isa"])
def test_experts_the_kernel_cannot_take_stay_float(quantized, isa, backend):
    """Where the dense layers would not get the low-bit kernel (quant_backend
    "dequantize"; the portable build, without a SIMD low-bit body), the experts are
    stacked float tensors, dequantized at load as before."""
    path = quantized("qwen3_moe", "w4a16-rtn")
    model = _model(LLM(str(path), kv_cache_memory="4MiB", quant_backend=backend))
    for moe in _sparse(model):
        assert isinstance(moe.gate_up, torch.Tensor) and moe.gate_up.dtype == torch.float32


# --- MXFP4 ------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_int8_codes_are_transformers_decoding_for_every_scale(dtype):
    """Random blocks under every E8M0 scale 0..255: ``q * scale`` (float32, then
    ``dtype``) is transformers' ``convert_moe_packed_tensors`` bit for bit, save the sign
    of zero (code 8, -0, is the integer 0), infinities (the largest scales overflow) on
    the same elements; the scales are the exact powers of two ``2^(s - 128)``, the
    subnormal ``2^-128`` and ``2^-127`` of ``s = 0, 1`` included (float32's subnormals
    reach ``2^-149``) and ``2^127`` for ``s = 255``."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 256, 3, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 256, (2, 256, 3), generator=gen, dtype=torch.uint8)
    scales[0, :, 0] = torch.arange(256, dtype=torch.uint8)  # every scale, once per block
    q, scale = mxfp4.int8_codes(blocks, scales)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert set(q.unique().tolist()) <= {0, 1, 2, 3, 4, 6, 8, 12, -1, -2, -3, -4, -6, -8, -12}
    assert torch.equal(scale.double(), torch.pow(2.0, scales.double() - 128))
    assert scale[0, 0, 0].item() == 2.0 ** -128 > 0 and scale[0, 1, 0].item() == 2.0 ** -127
    assert scale[0, 255, 0].item() == 2.0 ** 127
    ours = torch.stack([AffineCodes(q[e], scale[e], None, 32, 8).dequantize(dtype)
                        for e in range(2)])
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
    theirs = theirs.contiguous()
    assert not theirs.isnan().any() and theirs.isinf().any()
    assert torch.equal(ours, theirs)  # -0.0 == +0.0 here, inf == inf
    signed = theirs != 0
    assert torch.equal(_bits(ours)[signed], _bits(theirs)[signed])


def _mxfp4_codes(blocks: torch.Tensor, scales: torch.Tensor, form: str) -> AffineCodes:
    """An expert's codes as the engine holds them ("fp4": the E2M1 nibbles and the
    kernels' table) or as it held them before ("int8": twice the values as int8)."""
    if form == "fp4":
        return AffineCodes(*mxfp4.nibble_codes(blocks, scales), None, 32, 4, mxfp4.FP4_TIMES_2)
    return AffineCodes(*mxfp4.int8_codes(blocks, scales), None, 32, 8)


@pytest.mark.parametrize("isa", KERNEL_ISAS, indirect=True)
@pytest.mark.parametrize("form", ["fp4", "int8"])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_an_mxfp4_expert_on_the_kernel_is_the_decoded_product(isa, form, rows):
    """One MXFP4 expert as the engine builds it (:func:`kernel_linear`, one copy) against
    ``F.linear`` on the decoded weight in float32 for the same bf16 activations: on the
    AVX512-BF16 kernel the products are exact and only the sum's order and the bf16
    output differ (within 2^-8 of the sum, plus float32 sums' noise); the AVX2 kernel
    also rounds each block of 32 activations to 16-bit levels of the block's largest
    (each off by at most one level: ``amax / 32767``)."""
    _needs_lowbit_kernel()
    gen = torch.Generator().manual_seed(rows)
    blocks, scales = mxfp4.quantize(torch.randn(96, 256, generator=gen) * 0.05)
    weight = mxfp4.dequantize(blocks, scales, torch.float32)
    bias = torch.randn(96, generator=gen)
    linear = kernel_linear(_mxfp4_codes(blocks, scales, form), bias,
                           backend="kernel", device=CPU, one_copy=True)
    assert isinstance(linear, LowBitLinear) and linear.vnni_codes is None
    assert linear.avx2 == (not simd_available())
    x = torch.randn(rows, 256, generator=gen).to(torch.bfloat16)
    got = linear(x).float()
    want = F.linear(x.float(), weight, bias)
    bound = 2 ** -8 * (want - bias).abs() + 1e-6 * (x.float().abs() @ weight.abs().T) + 1e-6
    if linear.avx2:
        amax = x.float().view(rows, -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32)
        bound = bound + (amax.reshape(rows, -1) / 32767) @ weight.abs().T
    assert ((got - want).abs() <= bound).all()


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tiny_family, tmp_path_factory):
    """The tiny gpt-oss with MXFP4 experts, and transformers' float32 model whose experts
    are ``convert_moe_packed_tensors`` of the same blocks and scales."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from llmctl.models.loading import load_model

    path = tiny_family("gpt_oss")
    out = tmp_path_factory.mktemp("gpt-oss-mxfp4") / "mxfp4"
    packed = _mxfp4_checkpoint(path, out)
    reference = load_model(path, "float32")
    with torch.no_grad():
        params = dict(reference.named_parameters())
        for name, (blocks, scales) in packed.items():
            params[name].copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    return out, reference, encode(path, PROMPTS[1])


@pytest.mark.parametrize("isa", KERNEL_ISAS, indirect=True)
def test_mxfp4_experts_are_4_bit_codes_near_transformers(mxfp4_gpt_oss, isa):
    """gpt-oss's MXFP4 experts on the kernel path: one linear per expert on its E2M1
    nibbles as they are (the kernels' table, no offset) with its bias inside (gate/up
    rows interleaved as stored), 0.53 bytes per weight held (the 4-bit codes and the
    E8M0 scale byte per 32, as the checkpoint stores them; the int8 codes were 1.125,
    bf16 would be 2) plus the bias; logits near
    transformers' (:func:`_bound`: within 1 % of the largest logit with bf16 activations,
    measured 0.2 %: the experts are the only low-bit layers) and the same top-1 at 90 %
    of positions or more (measured 100 %)."""
    _needs_lowbit_kernel()
    path, reference, prompt = mxfp4_gpt_oss
    ids = (prompt * 4)[:40]
    llm = LLM(str(path), kv_cache_memory="4MiB", block_size=4)
    model = _model(llm)
    spec = model.spec
    for moe in _sparse(model):
        assert moe.gate_up_bias is None and moe.down_bias is None
        for linear in [*moe.gate_up, *moe.down]:
            assert isinstance(linear, LowBitLinear) and linear.kind == "fp4"
            assert linear.codebook == mxfp4.FP4_TIMES_2 and linear.group_size == 32
            assert linear.avx2 == (not simd_available()) and linear.zeros is None
            weights = linear.out_features * linear.in_features
            bias = linear.bias.numel() * linear.bias.element_size()
            assert _held(linear) + bias == linear.nbytes == (0.5 + 1 / 32) * weights + bias
        assert moe.gate_up[0].out_features == 2 * spec.expert_intermediate_size
    got = teacher_forced_logits(llm.engine, ids, 10)
    with torch.inference_mode():
        want = reference(torch.tensor([ids])).logits[0, 9:].float()
    rel, top1 = _compare(got, want)
    assert rel < _bound(0.01) and top1 >= 0.9, (rel, top1)


def test_the_benchmarks_count_the_active_low_bit_experts(quantized):
    """benchmarks/decode_bytes.py's batch-1 count of a mixture: the router and ``k`` of
    the ``E`` experts at their bytes as held (the codes), as
    ``LlamaModel.bytes_read_per_step`` counts them; the two differ by the one embedding
    row the lookup reads (which the model's count leaves out)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    from decode_bytes import bytes_read_per_token, llmctl_model_reads

    _needs_lowbit_kernel()
    model = _model(LLM(str(quantized("mixtral", "w8a16-rtn")), kv_cache_memory="4MiB"))
    assert all(isinstance(moe.gate_up[0], LowBitLinear) for moe in _sparse(model))
    row = model.embed.shape[1] * model.embed.element_size()
    assert bytes_read_per_token(llmctl_model_reads(model)) == model.bytes_read_per_step + row


# --- gpt-oss quantized by llmctl: per-expert int4 with biases --------------------------------
@pytest.mark.parametrize("isa", KERNEL_ISAS, indirect=True)
def test_quantized_gpt_oss_experts_run_on_the_lowbit_kernel(tiny_family, quantized, isa):
    """The tiny gpt-oss quantized W4A16 (groups of 32) per expert by ``llmctl quantize``:
    each expert one int4 linear, gate and up rows interleaved as the clamped SwiGLU reads
    them and the biases inside (the stacked biases then None); logits near transformers'
    on the dequantized weights, every low-bit layer taking bf16 activations: each position
    within 1 % of the largest logit (:func:`_bound`; measured 0.2-0.5 % on AVX512-BF16)
    but at most one, a token whose 2nd and 3rd router logits in the last layer are 0.007
    apart, which bf16's rounding routes to another expert (measured 18.7 %: routing is
    discontinuous); the same top-1 at 90 % of positions or more (measured 94 %)."""
    from tests.quant.test_gpt_oss_quant import dequantized_reference

    _needs_lowbit_kernel()
    path = quantized("gpt_oss", "w4a16-rtn")
    llm = LLM(str(path), kv_cache_memory="4MiB", block_size=4)
    model = _model(llm)
    width = model.spec.expert_intermediate_size
    prefix = "model.layers.0.mlp.experts.1"
    from safetensors.torch import load_file

    written = load_file(str(path / "model.safetensors"))
    # written in vLLM's streamed form: w13's rows already gate/up interleaved
    paired = written[f"{prefix}.w13_bias"]
    for moe in _sparse(model):
        assert moe.gate_up_bias is None and moe.down_bias is None
        for linear in [*moe.gate_up, *moe.down]:
            assert isinstance(linear, LowBitLinear) and linear.kind == "int4"
        assert moe.gate_up[0].out_features == 2 * width
    assert torch.equal(_sparse(model)[0].gate_up[1].bias.float(), paired.float())
    ids = _ids(seed=2)[0].tolist()
    got = teacher_forced_logits(llm.engine, ids, 7)
    with torch.inference_mode():
        want = dequantized_reference(tiny_family("gpt_oss"), path)(
            torch.tensor([ids])).logits[0, 6:].float()
    per_position = (got - want).abs().amax(-1) / want.abs().max()
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert (per_position > _bound(0.01)).sum() <= 1 and top1 >= 0.9, (per_position, top1)
