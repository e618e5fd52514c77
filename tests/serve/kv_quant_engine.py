"""The engine against transformers with K/V quantized as an 8-bit cache stores them: the
half of test_kv_cache_int8 and test_kv_cache_fp8 that does not depend on the format."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.llm import LLM
from tests.serve.conftest import PROMPTS, assert_all_blocks_free, encode

# transform(layer, kind, x): kind 0 = post-RoPE keys, 1 = values, x [B, T, kv_heads, d]
Transform = Callable[[int, int, torch.Tensor], torch.Tensor]


@contextmanager
def hf_kv_hooks(model, transform: Transform):
    """transformers' Llama layers with ``transform`` applied to each layer's post-RoPE
    keys and its values, its result used in their place. (HF's rotate-half layout
    permutes a head's dimensions relative to the engine's interleaved pairs: a head's
    absmax, hence its scale and codes, does not depend on the order.)"""
    import transformers.models.llama.modeling_llama as llama

    heads = model.config.num_key_value_heads
    rope = llama.apply_rotary_pos_emb
    current = [0]  # the layer whose attention runs (set by a pre-hook)

    def rotated(q, k, cos, sin, *args, **kwargs):
        q, k = rope(q, k, cos, sin, *args, **kwargs)  # k [B, H, T, d]
        return q, transform(current[0], 0, k.transpose(1, 2)).transpose(1, 2)

    def enter(i):
        def hook(module, args, kwargs):
            current[0] = i
        return hook

    def values(i):
        def hook(module, inputs, out):
            return transform(i, 1, out.view(*out.shape[:-1], heads, -1)).reshape(out.shape)
        return hook

    layers = list(enumerate(model.model.layers))
    hooks = [layer.self_attn.register_forward_pre_hook(enter(i), with_kwargs=True)
             for i, layer in layers]
    hooks += [layer.self_attn.v_proj.register_forward_hook(values(i)) for i, layer in layers]
    llama.apply_rotary_pos_emb = rotated
    try:
        yield
    finally:
        llama.apply_rotary_pos_emb = rope
        for h in hooks:
            h.remove()


def quantized_reference(path, prompts_ids: list[list[int]], max_tokens: int,
                        transform: Transform) -> dict[tuple[int, ...], list[int]]:
    """transformers greedy decoding (float32) whose K (after RoPE) and V pass through
    ``transform`` (quantize, then dequantize) before its cache stores them: prompt ids ->
    continuation."""
    from llmctl.models.hf_generate import hf_generate
    from llmctl.models.loading import load_model, load_tokenizer

    model = load_model(path)
    tokenizer = load_tokenizer(path)
    with hf_kv_hooks(model, transform):
        return {tuple(ids): hf_generate(model, tokenizer, ids, max_tokens=max_tokens)
                for ids in prompts_ids}


def check(llm: LLM, reference, path, prompts=PROMPTS, max_tokens=30, n=1) -> list:
    """Greedy outputs of ``prompts`` equal the reference's, and every block is free."""
    ids = [encode(path, p) for p in prompts]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens, n=n))
    for prompt_ids, out in zip(ids, outs):
        for o in out.outputs:
            assert o.token_ids == reference[tuple(prompt_ids)][:max_tokens], out.request_id
    assert_all_blocks_free(llm.engine)
    return outs


def check_prefix_hits_preemption_and_forks(path, reference, kv_cache_dtype: str) -> None:
    """A prefix-cache hit reads another request's codes; preemption recomputes them; a
    fork of a partial block copies them (copy-on-write, with int8's per-slot scales):
    every path gives the reference's tokens."""
    # 30 blocks of 4 tokens for six sequences of up to 99 tokens: preemption
    llm = LLM(str(path), kv_cache_dtype=kv_cache_dtype, block_size=4, num_kv_blocks=30,
              max_model_len=112, max_num_batched_tokens=5)
    check(llm, reference, path)
    assert llm.engine.stats().num_preemptions > 0
    llm = LLM(str(path), kv_cache_dtype=kv_cache_dtype, kv_cache_memory="4MiB")
    check(llm, reference, path, PROMPTS[3:4])
    again = check(llm, reference, path, PROMPTS[3:4], max_tokens=20)
    assert again[0].metrics.num_cached_tokens >= 16  # read back from the first request's blocks
    # PROMPTS[1] is 10 tokens: the three forks share a partial block until they write it
    check(llm, reference, path, PROMPTS[1:2], max_tokens=20, n=3)


def check_fused_decode_layers_bit_for_bit(path, kv_cache_dtype: str) -> None:
    """The fused native decode layers read and write the cache exactly as the layer loop
    does: same tokens, same log-probs."""
    # no prefix caching: the second run's prompts would start from cached blocks, whose
    # prefill takes another (bf16-rounded) path than the first run's fresh one
    llm = LLM(str(path), dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_num_seqs=4,
              kv_cache_memory="4MiB", bf16_gemm="own", enable_prefix_caching=False)
    net = llm.engine.target.model
    assert net.decode_layers is not None
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
    prompts = PROMPTS[:4]
    fused = llm.generate(prompts, params)
    net.decode_layers = None
    plain = llm.generate(prompts, params)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


# How far one prefill's logits may be from decoding token by token through the cache.
# int8: float32 noise (1e-4). fp8: the prefill (SDPA) and the decode kernel sum in other
# orders, and float32 noise in layer 0's output can move a later layer's K or V across an
# E4M3 rounding boundary (3 mantissa bits: one step is up to 1/8 of the value); on AMD
# Zen 3 with the -march=native build one such flip moved a logit by 5.5e-3, against the
# 0.62 that fp8 itself moves them (test_kv_cache_fp8): 2e-2 still tells a cache the
# prefill ignored (it would differ by about the fp8 shift).
PREFILL_VS_DECODE_ATOL = {"int8": 1e-4, "fp8": 2e-2}


def prefill_logit_shift(path, kv_cache_dtype: str) -> float:
    """A fresh prompt attends over its K/V as stored (quantized), so one prefill's rows
    equal decoding it token by token through the cache (within PREFILL_VS_DECODE_ATOL);
    returns the largest change of those logits against a float cache."""
    from llmctl.serve.model.scoring import prompt_logits, teacher_forced_logits

    ids = encode(path, PROMPTS[3])
    llm = LLM(str(path), kv_cache_dtype=kv_cache_dtype, kv_cache_memory="4MiB")
    prefill = prompt_logits(llm.engine, ids)
    decoded = teacher_forced_logits(llm.engine, ids, 1)
    atol = PREFILL_VS_DECODE_ATOL[kv_cache_dtype]
    torch.testing.assert_close(prefill, decoded, atol=atol, rtol=1e-4)
    full = teacher_forced_logits(LLM(str(path), kv_cache_memory="4MiB").engine, ids, 1)
    return (decoded - full).abs().max().item()
