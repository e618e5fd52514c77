"""Prompt log-probs from the engine equal transformers' log_softmax, in every regime."""

from __future__ import annotations

import pytest
import torch

from llmctl.errors import UsageError
from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.llm import LLM
from tests.serve.conftest import PROMPTS, assert_all_blocks_free, encode, hf_model

TOP = 3


def _reference(path, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits: row p scores token p + 1."""
    with torch.inference_mode():
        logits = hf_model(str(path))(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check(path, out) -> None:
    ids = out.prompt_token_ids
    entries = out.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    ref = _reference(path, ids)
    got = torch.tensor([e.logprob for e in entries[1:]])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:], dtype=torch.long)]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    for p, e in enumerate(entries[1:]):
        assert e.token_id == ids[p + 1]
        top_vals, top_ids = ref[p].topk(TOP)
        assert [t for t, _ in e.top] == top_ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in e.top]), top_vals,
                                   atol=1e-4, rtol=0)


def _params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP, **kw)


@pytest.mark.parametrize("budget", [512, 7])  # one prefill, or chunks of 7 tokens
def test_prompt_logprobs_equal_transformers(tiny_llama, budget):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB",
              max_num_batched_tokens=budget)
    outs = llm.generate([encode(tiny_llama, p) for p in PROMPTS], _params())
    for out in outs:
        _check(tiny_llama, out)
    assert_all_blocks_free(llm.engine)


def test_prefix_cache_is_bypassed_then_used_again(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", block_size=4)
    prompt = encode(tiny_llama, PROMPTS[3])
    plain = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([prompt], plain)  # fills the prefix cache
    with_lp = llm.generate([prompt], _params())[0]
    assert with_lp.metrics.num_cached_tokens == 0
    _check(tiny_llama, with_lp)
    again = llm.generate([prompt], plain)[0]
    assert again.metrics.num_cached_tokens > 0  # the cache itself still works
    assert again.prompt_logprobs is None


def test_under_preemption_and_with_n(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=30,
              max_model_len=112, max_num_batched_tokens=5)
    outs = llm.generate([encode(tiny_llama, p) for p in PROMPTS],
                        _params(n=2, ignore_eos=True).model_copy(update={"max_tokens": 30}))
    assert llm.engine.stats().num_preemptions > 0
    for out in outs:
        assert len(out.outputs) == 2
        _check(tiny_llama, out)
    assert_all_blocks_free(llm.engine)


def test_target_without_prompt_rows_refuses(tiny_llama):
    """A target that says it serves no prompt log-probs (Target.serves_prompt_logprobs)
    refuses such requests in add_request; its runner is never asked for prompt rows."""
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")

    class PlainRunner:  # execute and copy_blocks only
        def __init__(self, inner) -> None:
            self.execute, self.copy_blocks = inner.execute, inner.copy_blocks

    llm.engine.runner = PlainRunner(llm.engine.runner)
    llm.engine.target.serves_prompt_logprobs = False
    with pytest.raises(UsageError, match="prompt log-probs"):
        llm.engine.add_request("r", [5, 6, 7], _params())
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].finished
