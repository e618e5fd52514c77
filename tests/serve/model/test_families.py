"""Every family llmctl runs, on the engine, against transformers in float32.

The models are the tiny random checkpoints of ``tests/data/families/`` (random weights
only: no real Gemma, Phi, Granite or OLMo checkpoint can be downloaded here), each with
its family's features switched on: Gemma 2's attention and final soft-caps,
``query_pre_attn_scalar`` and alternating windows of 8; Gemma 3's per-head (1 + w) q/k
norms, local RoPE base on sliding layers and linear scaling on global ones; Phi-3's fused
projections, LongRoPE (original context 32) with half the head rotated and a window of
16; Granite's four multipliers; OLMo 2's post-norms and whole-projection q/k norms;
Llama 3.1's ``llama3`` RoPE. Configs without an EOS id: both sides run every token.
"""

from __future__ import annotations

import pytest
import torch

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.llm import LLM
from llmctl.serve.model.scoring import teacher_forced_logits
from tests.serve.conftest import PROMPTS, assert_all_blocks_free, encode, hf_greedy, hf_model
from tests.tiny import FAMILY_NAMES

NEW_TOKENS = 72
# Phi-3's LongRoPE has two sets of frequencies: the short one for contexts up to 32, the
# long one past that. The engine picks one for its whole context (llama.cpp's and vLLM's
# choice), the long one here (max_model_len 256); transformers by sequence length, and
# generate recomputes the cache with the long set when a sequence crosses 32. So the
# prompts of a Phi-3 comparison are longer than 32 tokens (both sides: the long set
# throughout), and a context of 32 checks the short set.
LONG_PROMPTS = {"phi3": 33}


def _greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _prompts(path, name: str) -> list[list[int]]:
    ids = [encode(path, p) for p in PROMPTS[:4]]
    least = LONG_PROMPTS.get(name)
    return ids if least is None else [(p + ids[3] * 2)[:least + i] for i, p in enumerate(ids)]


def test_longrope_short_set_within_the_original_context(tiny_family):
    """An engine whose context is Phi-3's original 32 rotates with the short set: greedy
    tokens equal generate's, which never leaves the short set below 33 tokens."""
    path = tiny_family("phi3")
    ids = [encode(path, p) for p in PROMPTS[:3]]
    llm = LLM(str(path), kv_cache_memory="4MiB", block_size=4, max_model_len=32)
    outs = llm.generate(ids, [_greedy(32 - len(p)) for p in ids])
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(path, p, 32 - len(p)) for p in ids]


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_logits_equal_transformers(tiny_family, name):
    """A 7-token fresh prefill, then one token at a time through the paged cache:
    every position's logits within 1e-4 of transformers' (float32)."""
    path = tiny_family(name)
    ids = (encode(path, PROMPTS[3]) * 2)[:80]
    got = teacher_forced_logits(LLM(str(path), kv_cache_memory="4MiB", block_size=4).engine,
                                ids, 7)
    with torch.inference_mode():
        want = hf_model(str(path))(torch.tensor([ids])).logits[0, 6:].float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_greedy_tokens_equal_transformers(tiny_family, name):
    """72 new tokens for a batch of prompts, equal to ``generate``'s; past every window
    and (Phi-3) past LongRoPE's switch. Then the same prompts again: prefix-cache hits."""
    path = tiny_family(name)
    ids = _prompts(path, name)
    want = [hf_greedy(path, p, NEW_TOKENS) for p in ids]
    llm = LLM(str(path), kv_cache_memory="8MiB", block_size=4)
    for _ in range(2):
        outs = llm.generate(ids, _greedy())
        assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.engine.stats().prefix_cache_hit_tokens > 0
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3"])
def test_chunked_prefill_and_preemption_across_windows(tiny_family, name):
    """Prompt chunks of 5 tokens (a window of 8 spans chunk boundaries), and a pool too
    small for the batch (sequences preempted and recomputed): the same tokens."""
    path = tiny_family(name)
    ids = _prompts(path, name)
    want = [hf_greedy(path, p, NEW_TOKENS) for p in ids]
    chunked = LLM(str(path), kv_cache_memory="8MiB", block_size=4, max_num_batched_tokens=5)
    assert [o.outputs[0].token_ids for o in chunked.generate(ids, _greedy())] == want
    small = LLM(str(path), num_kv_blocks=40, block_size=4, max_model_len=160)
    assert [o.outputs[0].token_ids for o in small.generate(ids * 3, _greedy())] == want * 3
    assert small.engine.stats().num_preemptions > 0


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_bfloat16_with_the_native_kernels_stays_close(tiny_family, name):
    """bf16 weights, activations and cache (the native kernels where built) against the
    float32 reference: every logit within 0.35. bf16 keeps ~3 significant digits; the
    bound is about 3x the largest error measured on these models (Intel Xeon, AMX)."""
    path = tiny_family(name)
    ids = encode(path, PROMPTS[3])
    got = teacher_forced_logits(LLM(str(path), kv_cache_memory="4MiB", block_size=4,
                                    dtype="bfloat16").engine, ids, 7)
    with torch.inference_mode():
        want = hf_model(str(path))(torch.tensor([ids])).logits[0, 6:].float()
    torch.testing.assert_close(got, want, atol=0.35, rtol=0)


def test_an_unknown_model_type_names_the_families(tmp_path):
    from llmctl.errors import UnsupportedArchitectureError
    from llmctl.serve.model.decoder import ModelSpec

    with pytest.raises(UnsupportedArchitectureError) as info:
        ModelSpec.from_config({"model_type": "falcon", "vocab_size": 8, "hidden_size": 8,
                               "intermediate_size": 8, "num_hidden_layers": 1,
                               "num_attention_heads": 1})
    message = str(info.value)
    for family in ("gemma2", "gemma3_text", "phi3", "granite", "olmo2", "llama"):
        assert family in message
    assert "docs/architecture.md" in message


# --- speculative decoding, 8-bit KV and LoRA on the families -----------------------------
@pytest.mark.parametrize("name", ["gemma2", "phi3", "olmo2"])
def test_speculative_decoding_keeps_the_tokens(tiny_family, name):
    """n-gram drafts verified through each family's forward (several query tokens per
    sequence, windows, soft-caps): the greedy tokens stay transformers'."""
    path = tiny_family(name)
    ids = _prompts(path, name)[2:]
    llm = LLM(str(path), kv_cache_memory="8MiB", block_size=4,
              speculative={"method": "ngram", "num_speculative_tokens": 3})
    outs = llm.generate(ids, _greedy())
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, NEW_TOKENS)
                                                      for p in ids]
    stats = llm.engine.stats()
    # drafts were verified (several query tokens per sequence); on random weights a
    # family's output may repeat itself too little for any to be accepted
    assert stats.spec_verify_steps > 0 and stats.spec_draft_tokens > 0


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3", "olmo2"])
def test_8bit_kv_cache_stays_close(tiny_family, name, kv):
    """bf16 weights with an int8 (scale per slot and head) or fp8 (E4M3) cache against
    the float32 reference: every logit within 0.5 (the bf16 bound above, plus the cache's
    own rounding: fp8 keeps 3 mantissa bits)."""
    path = tiny_family(name)
    ids = encode(path, PROMPTS[3])
    llm = LLM(str(path), kv_cache_memory="4MiB", block_size=4, dtype="bfloat16",
              kv_cache_dtype=kv)
    got = teacher_forced_logits(llm.engine, ids, 7)
    with torch.inference_mode():
        want = hf_model(str(path))(torch.tensor([ids])).logits[0, 6:].float()
    torch.testing.assert_close(got, want, atol=0.5, rtol=0)


@pytest.mark.parametrize("name,targets", [
    ("gemma2", None),
    ("olmo2", ["q_proj", "v_proj", "down_proj"]),
    # Phi-3's checkpoint fuses q/k/v and gate/up: PEFT adapts the fused modules
    ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
])
def test_lora_greedy_equals_peft(tiny_family, tmp_path, name, targets):
    """A random PEFT adapter served by the engine beside the base model: each request's
    greedy tokens equal transformers + PEFT's (float32), the base request's the base's."""
    from tests.lora_adapters import build_adapter, peft_model

    path = tiny_family(name)
    adapter = build_adapter(path, tmp_path / "lora", rank=4, alpha=8, seed=1, targets=targets)
    prompt = _prompts(path, name)[3]
    llm = LLM(str(path), loras={"a": str(adapter)}, kv_cache_memory="8MiB", block_size=4)
    outs = llm.generate([prompt, prompt], _greedy(24), lora=["a", None])
    ref = peft_model(path, adapter)
    with torch.inference_mode():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert outs[0].outputs[0].token_ids == want
    assert outs[1].outputs[0].token_ids == hf_greedy(path, prompt, 24)
    assert want != hf_greedy(path, prompt, 24)  # the adapter changes the tokens
