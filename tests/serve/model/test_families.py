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
