"""The fused decode layers (csrc/decode_layer.cpp) on the new families' layer forms give
the very tokens and log-probs of the layer loop (LlamaModel.forward), compared exactly:
Gemma's GeGLU and scaled embeddings, Gemma 2's sandwich norms, soft-capped attention,
``query_pre_attn_scalar`` and alternating windows, Gemma 3's per-layer RoPE tables,
Phi-3's partial rotary (LongRoPE, half of each head), Granite's attention and residual
multipliers, OLMo 2's post-norms (no input or pre-MLP norm: the layers read the residual
stream), Llama 3.1. The tiny checkpoints of tests/data/families (head_dim 16: the portable
attention loop), in this CPU's native build (AVX512-BF16 forms here) and the AVX2 build
(the widening bf16 form), bf16, int8 and fp8 caches.

A q/k norm is the fused layer's only where the layer loop norms q and k with the native
kernel (:meth:`NormActKernels.qk_norm`), as the engine's bf16 layer loop does: Gemma 3 (per head) and OLMo 2 (per projection) included;
:meth:`DecodeLayers.build` returns None for torch's q/k norm, for an activation it has no
kernel for, and where a layer's RoPE runs in torch.
"""

from __future__ import annotations

import dataclasses

import pytest

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.llm import LLM
from llmctl.serve.kernels import cpu as cpu_kernels
from llmctl.serve.layers import decode_layers, quant_linear
from llmctl.serve.layers.decode_layers import DecodeLayers
from llmctl.serve.model.decoder import TorchNormAct
from tests.serve.conftest import PROMPTS, encode
from tests.serve.paged_cases import needs_kernels

QK_NORMED = ("gemma3", "olmo2")
FAMILIES = ("gemma", "gemma2", "gemma3", "phi3", "granite", "olmo2", "llama31")


@pytest.fixture(params=["native", "avx2"])
def variant(request, monkeypatch):
    """This CPU's build, or the AVX2 one with bf16 weights oneDNN cannot pack (Zen 3)."""
    if request.param == "avx2":
        if "avx2" not in cpu_kernels.supported_variants():
            pytest.skip("this CPU cannot run the avx2 kernel variant")
        monkeypatch.setattr(quant_linear, "onednn_bf16_supported", lambda: False)
    monkeypatch.setenv(cpu_kernels.VARIANT_ENV, request.param)
    if cpu_kernels.decode_layer_kernel() is None:
        pytest.skip(f"the {request.param} build has no matrix kernel for the fused layers")
    return request.param


def _engine(path, monkeypatch, kv_cache_dtype: str = "auto") -> LLM:
    # no prefix caching: a second run's prompts would start from cached blocks
    return LLM(str(path), dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_num_seqs=6,
               kv_cache_memory="8MiB", bf16_gemm="own", enable_prefix_caching=False)


def _fused(llm: LLM) -> DecodeLayers | None:
    net = llm.engine.target.model
    net.decode_layers = DecodeLayers.build(net)
    return net.decode_layers


def _fused_equals_layer_loop(llm: LLM, path, monkeypatch) -> None:
    net = llm.engine.target.model
    calls = []
    real = decode_layers.DecodeLayers.__call__
    monkeypatch.setattr(decode_layers.DecodeLayers, "__call__",
                        lambda self, *a: calls.append(a[0].shape[0]) or real(self, *a))
    prompts = [encode(path, p) for p in PROMPTS[:5]]
    # 24 tokens: past the windows of 8 and 16, so the sliding layers drop keys
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3, ignore_eos=True)
    fused = llm.generate(prompts, params)
    assert calls and max(calls) == len(prompts)  # the fused layers ran the decode steps
    net.decode_layers = None
    plain = llm.generate(prompts, params)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@needs_kernels
@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_decodes_bit_for_bit_like_the_layer_loop(tiny_family, name, variant,
                                                             monkeypatch):
    """Every family's engine takes the fused layers (Gemma 3's and OLMo 2's q/k norms on
    the native kernel in both paths) and decodes as its layer loop does."""
    path = tiny_family(name)
    llm = _engine(path, monkeypatch)
    net = llm.engine.target.model
    if name in QK_NORMED:
        assert all(layer.qk_norm is not None for layer in net.layers)
    assert _fused(llm) is not None
    _fused_equals_layer_loop(llm, path, monkeypatch)


@needs_kernels
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("name", ["gemma2", "phi3", "granite"])
def test_8bit_caches_decode_bit_for_bit_like_the_layer_loop(tiny_family, name,
                                                            kv_cache_dtype, monkeypatch):
    """Soft-capped attention, partial rotary and the residual multiplier on int8 and fp8
    caches (the _i8 / _f8 RoPE and attention kernels), this CPU's native build."""
    path = tiny_family(name)
    llm = _engine(path, monkeypatch, kv_cache_dtype)
    assert _fused(llm) is not None
    _fused_equals_layer_loop(llm, path, monkeypatch)


@needs_kernels
def test_what_the_fused_layer_does_not_compute_keeps_the_layer_loop(tiny_family, monkeypatch):
    """None (the layer loop runs) for a q/k norm, an activation without a native kernel,
    and a layer whose RoPE runs in torch (partial rotary without the native RoPE)."""
    if cpu_kernels.decode_layer_kernel() is None:
        pytest.skip("no matrix kernel for the fused layers on this CPU")
    gemma3 = _engine(tiny_family("gemma3"), monkeypatch).engine.target.model
    assert any(layer.qk_norm is not None for layer in gemma3.layers)
    assert DecodeLayers.build(gemma3) is not None
    gemma3.norm_act = TorchNormAct()  # the layer loop on torch's ops (q/k norms included)
    assert DecodeLayers.build(gemma3) is None
    gemma2 = _engine(tiny_family("gemma2"), monkeypatch).engine.target.model
    assert DecodeLayers.build(gemma2) is not None
    gemma2.spec = dataclasses.replace(gemma2.spec, hidden_act="gelu")
    assert DecodeLayers.build(gemma2) is None
    phi3 = _engine(tiny_family("phi3"), monkeypatch).engine.target.model
    assert DecodeLayers.build(phi3) is not None
    phi3.layer_rope = [(table, None) for table, _ in phi3.layer_rope]  # RoPE in torch
    assert DecodeLayers.build(phi3) is None
