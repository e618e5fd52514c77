"""The fused decode layers (csrc/decode_layer.cpp) on AVX2-only CPUs: bf16 weights on the
widening kernel (Matrix kind 2, csrc/gemv_bf16_avx2.cpp) and int4/int8 codes on the AVX2
low-bit kernel (kind 3, csrc/lowbit_avx2.cpp) give the very tokens and log-probs of the
Python layer loop, for bf16, int8 and fp8 caches, with biases, a sliding window and LoRA
adapters.

An AVX2-only CPU (AMD Zen 3) is reproduced on any CPU that runs the ``avx2`` kernel
variant: the variant's build, and oneDNN refusing to pack bf16 (as it does there), so
dense bf16 layers become :class:`WideningBF16Linear`. The ``native`` runs check the same
on this CPU's own forms (kinds 0/1 on AVX512-BF16, 2/3 on an AVX2-only CPU)."""

from __future__ import annotations

import pytest
import torch

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.llm import LLM
from llmctl.serve.kernels import cpu as cpu_kernels
from llmctl.serve.layers import decode_layers, quant_linear
from tests.serve.conftest import PROMPTS, encode
from tests.serve.paged_cases import needs_kernels

# name -> compressed-tensors scheme (tests/serve/quant_checkpoints.py), None: bf16 weights;
# asymmetric int4 has group offsets (the kernel's z), symmetric int8 none
WEIGHTS = {"bf16": None, "w4": "w4-g64-asym", "w8": "w8-g32"}
# the AVX2 forms: bf16 -> kind 2 (up to the widening layer's kernel rows), codes -> kind 3
AVX2_FORMS = {"bf16": (2, quant_linear.WideningBF16Linear.KERNEL_MAX_ROWS),
              "w4": (3, decode_layers.MAX_ROWS), "w8": (3, decode_layers.MAX_ROWS)}
AVX2_MISSING = "this CPU cannot run the avx2 kernel variant (needs AVX2 + FMA + F16C)"


def _use_avx2(monkeypatch) -> None:
    """The avx2 build, and bf16 weights that oneDNN cannot pack (AMD Zen 3)."""
    if "avx2" not in cpu_kernels.supported_variants():
        pytest.skip(AVX2_MISSING)
    monkeypatch.setenv(cpu_kernels.VARIANT_ENV, "avx2")
    monkeypatch.setattr(quant_linear, "onednn_bf16_supported", lambda: False)


@pytest.fixture(params=["avx2", "native"])
def variant(request, monkeypatch):
    if request.param == "avx2":
        _use_avx2(monkeypatch)
    else:
        monkeypatch.setenv(cpu_kernels.VARIANT_ENV, "native")
    return request.param


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    """A tiny Llama with head_dim 64 (the vectorised attention bodies run) and random
    biases on every projection (q/k/v, o, gate/up, down): zero biases, as transformers
    initialises them, would not tell an added bias from a skipped one."""
    from safetensors.torch import load_file, save_file

    from tests.tiny import build_tiny_llama

    path = build_tiny_llama(tmp_path_factory.mktemp("fused-avx2") / "biased", seed=5,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                            attention_bias=True, mlp_bias=True)
    weights = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    for name, t in weights.items():
        if name.endswith(".bias"):
            weights[name] = 0.3 * torch.randn(t.shape, generator=gen).to(t.dtype)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def mistral(tiny_variants):
    """A window of 16 on both layers (test_sliding_window.py's model), head_dim 64."""
    return tiny_variants("mistral-w16", model_type="mistral", sliding_window=16,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         eos_token_id=None, seed=3)


def _checkpoint(src, tmp_path, weights: str):
    from tests.serve.quant_checkpoints import write_quantized

    scheme = WEIGHTS[weights]
    return src if scheme is None else write_quantized(src, tmp_path / weights, scheme)[0]


def _llm(path, kv_cache_dtype: str = "auto") -> LLM:
    # no prefix caching: the second run's prompts would start from cached blocks, whose
    # prefill takes another path than the first run's fresh one
    return LLM(str(path), dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_num_seqs=6,
               kv_cache_memory="8MiB", bf16_gemm="own", enable_prefix_caching=False)


def _fused_equals_layer_loop(llm: LLM, prompts, max_tokens: int, monkeypatch) -> list[int]:
    """Generate with the fused layers, then with the layer loop: the same tokens and the
    same log-probs, exactly. Returns the fused calls' row counts."""
    net = llm.engine.target.model
    assert net.decode_layers is not None
    calls = []
    real = decode_layers.DecodeLayers.__call__
    monkeypatch.setattr(decode_layers.DecodeLayers, "__call__",
                        lambda self, *a: calls.append(a[0].shape[0]) or real(self, *a))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3, ignore_eos=True)
    fused = llm.generate(prompts, params)
    net.decode_layers = None
    plain = llm.generate(prompts, params)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    return calls


def _kinds(llm: LLM) -> set[int]:
    return {m.kind for mats in llm.engine.target.model.decode_layers._matrices for m in mats}


@needs_kernels
@pytest.mark.parametrize("weights", list(WEIGHTS))
def test_avx2_models_take_the_fused_layer_with_the_avx2_forms(weights, tiny_llama, tmp_path,
                                                              monkeypatch):
    """Under the avx2 variant every projection has a form (kind 2 or 3) and the model
    builds its fused layers, whose rows are the fewest any form takes; the portable build
    has no matrix kernel and keeps the layer loop."""
    _use_avx2(monkeypatch)
    path = _checkpoint(tiny_llama, tmp_path, weights)
    assert cpu_kernels.decode_layer_kernel() is not None
    llm = _llm(path)
    net = llm.engine.target.model
    kind, rows = AVX2_FORMS[weights]
    assert net.decode_layers is not None and _kinds(llm) == {kind}
    assert net.decode_layers.max_rows == rows
    layer = net.layers[0].qkv
    assert isinstance(layer, quant_linear.WideningBF16Linear) if kind == 2 else layer.avx2
    monkeypatch.setenv(cpu_kernels.VARIANT_ENV, "portable")
    assert cpu_kernels.decode_layer_kernel() is None
    assert decode_layers.DecodeLayers.build(_llm(path).engine.target.model) is None


@needs_kernels
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("weights", list(WEIGHTS))
def test_fused_avx2_layers_decode_bit_for_bit_like_the_layer_loop(weights, kv_cache_dtype,
                                                                  tiny_llama, tmp_path,
                                                                  monkeypatch):
    """Six concurrent requests (steps of 1-6 rows: the low-bit kernel's row tiles of 4
    and a second tile) on tiny_llama (head_dim 16: attention's portable loop), every
    cache kind."""
    _use_avx2(monkeypatch)
    llm = _llm(_checkpoint(tiny_llama, tmp_path, weights), kv_cache_dtype)
    assert _kinds(llm) == {AVX2_FORMS[weights][0]}
    calls = _fused_equals_layer_loop(llm, PROMPTS, 10, monkeypatch)
    assert calls and max(calls) == len(PROMPTS)


@needs_kernels
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("weights", list(WEIGHTS))
def test_fused_layers_add_every_bias_as_the_layer_loop_does(weights, kv_cache_dtype, variant,
                                                           tiny64, tmp_path, monkeypatch):
    """Random biases on q/k/v, o, gate/up and down, head_dim 64 (the AVX2 or AVX-512
    attention bodies): the widening kernel's bias joins its float32 sums, the others'
    is added to the rounded product, as each Python layer does."""
    llm = _llm(_checkpoint(tiny64, tmp_path, weights), kv_cache_dtype)
    net = llm.engine.target.model
    if variant == "native" and net.decode_layers is None:
        assert cpu_kernels.native_variant() not in ("avx2", "avx512-bf16")
        pytest.skip("no fused form for these weights on this CPU's native build")
    assert all(m.bias for mats in net.decode_layers._matrices for m in mats)
    if variant == "avx2":
        assert _kinds(llm) == {AVX2_FORMS[weights][0]}
    calls = _fused_equals_layer_loop(llm, PROMPTS, 10, monkeypatch)
    assert calls and max(calls) == len(PROMPTS)


@needs_kernels
@pytest.mark.parametrize("weights", ["bf16", "w4"])
def test_fused_avx2_layers_honour_the_sliding_window(weights, mistral, tmp_path, monkeypatch):
    """A window of 16 on every layer, 60 tokens past it: each layer's window reaches its
    attention call."""
    _use_avx2(monkeypatch)
    llm = _llm(_checkpoint(mistral, tmp_path, weights))
    assert llm.engine.target.model.decode_layers._windows == [16, 16]
    prompts = [encode(mistral, p) for p in PROMPTS[:3]]
    calls = _fused_equals_layer_loop(llm, prompts, 60, monkeypatch)
    assert len(calls) >= 59


@needs_kernels
@pytest.mark.parametrize("weights", ["bf16", "w4"])
def test_fused_avx2_layers_add_lora_terms_as_the_layer_loop_does(weights, tiny_llama,
                                                                 tiny_loras, tmp_path,
                                                                 monkeypatch):
    """Steps mixing three adapters and base rows: each fused linear's product, then its
    adapters' terms (csrc/lora.cpp, the layer loop's kernel)."""
    _use_avx2(monkeypatch)
    llm = LLM(str(_checkpoint(tiny_llama, tmp_path, weights)), dtype="bfloat16", max_num_seqs=6,
              kv_cache_memory="8MiB", enable_prefix_caching=False,
              loras={k: str(v) for k, v in tiny_loras.items()})
    net = llm.engine.target.model
    assert _kinds(llm) == {AVX2_FORMS[weights][0]}
    adapter_steps = []
    real = decode_layers.DecodeLayers.__call__
    monkeypatch.setattr(decode_layers.DecodeLayers, "__call__",
                        lambda self, *a: adapter_steps.append(len(a) > 6 and a[6] is not None)
                        or real(self, *a))
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
    names = ["all4", None, "some8", "attn1", "all4", None]
    fused = llm.generate(PROMPTS, params, lora=names)
    assert sum(adapter_steps) >= params.max_tokens - 1
    net.decode_layers = None
    plain = llm.generate(PROMPTS, params, lora=names)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@needs_kernels
def test_silu_mul_gives_the_same_bits_in_every_simd_variant():
    """The AVX2 SiLU body (8 lanes) computes what the AVX-512 one does (exp8_ps is
    exp_ps's polynomial with an exact 2^n), so the fused layers and the layer loop agree
    across builds too; odd widths run the scalar tail."""
    variants = [v for v in cpu_kernels.supported_variants() if v != "portable"]
    if not variants:
        pytest.skip(AVX2_MISSING)
    gen = torch.Generator().manual_seed(3)
    gate_up = (4 * torch.randn((5, 2 * 203), generator=gen)).bfloat16()
    outs = []
    for name in variants:
        out = torch.empty((5, 203), dtype=torch.bfloat16)
        cpu_kernels.load_variant(name).silu_mul_bf16(gate_up.data_ptr(), out.data_ptr(), 5, 203, 1)
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    gate, up = gate_up.chunk(2, -1)
    want = (torch.nn.functional.silu(gate.float()).bfloat16().float() * up.float()).bfloat16()
    assert ((outs[0].float() - want.float()).abs() <= want.float().abs() * 2 ** -7).all()
