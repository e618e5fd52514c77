"""Speculative decoding: greedy output identical to plain decoding; sampled output
distributed as the target model's (rejection sampling), on synthetic distributions and
end to end on a toy target/draft pair."""

from __future__ import annotations

import pytest
import torch

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.llm import LLM
from llmctl.serve.sample.rejection_sampler import greedy_verify, rejection_sample
from llmctl.serve.sample.spec_decode import ngram_lookup
from tests.serve.conftest import PROMPTS, assert_all_blocks_free, encode, hf_greedy, hf_model
from tests.serve.sample.test_sampler import chi2_pvalue


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    assert ngram_lookup(tokens, 3, 1, 3) == [4, 5, 6]  # latest earlier [1, 2, 3]
    assert ngram_lookup(tokens, 10, 1, 3) == [4, 5, 6, 7, 1, 2, 3]
    assert ngram_lookup([5, 6, 7, 8], 3, 1, 3) == []
    assert ngram_lookup([4, 1, 2, 0, 2], 2, 1, 3) == [0, 2]  # falls back to a 1-gram


def test_greedy_verify():
    assert greedy_verify([4, 5, 6], [4, 5, 9, 1]) == [4, 5, 9]
    assert greedy_verify([4, 5], [4, 5, 8]) == [4, 5, 8]
    assert greedy_verify([7], [1, 2]) == [1]


def _simulate(p, q, trials, seed, one_hot_token=None):
    gen = torch.Generator().manual_seed(seed)
    first = torch.zeros(p.shape[1])
    second = torch.zeros(p.shape[1])
    k = p.shape[0] - 1
    for _ in range(trials):
        if one_hot_token is None:
            draft = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(k)]
            out = rejection_sample(draft, p, q, gen)
        else:
            out = rejection_sample([one_hot_token] * k, p, None, gen)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second


def test_rejection_sampling_follows_the_target_distribution():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 8, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(2, 8, generator=gen) * 1.5, dim=-1)
    first, second = _simulate(p, q, 6000, seed=1)
    assert chi2_pvalue(first, p[0] * first.sum()) > 1e-3
    # the second token exists when the first draft was accepted; it then follows p[1]
    assert chi2_pvalue(second, p[1] * second.sum()) > 1e-3
    # power: accepting every draft would have given q, which the test rejects
    assert chi2_pvalue(first, q[0] * first.sum()) < 1e-6


def test_rejection_sampling_with_a_deterministic_proposer():
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(2, 6, generator=gen), dim=-1)
    first, _ = _simulate(p, None, 5000, seed=4, one_hot_token=2)
    assert chi2_pvalue(first, p[0] * first.sum()) > 1e-3


REPETITIVE = ("The file object is open. The file object is closed. The file object is "
              "open. The file object")


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_with_speculation_equals_plain_greedy(tiny_llama, tiny_near_draft, method):
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft":
        spec["draft_model"] = str(tiny_near_draft)
    llm = LLM(str(tiny_llama), speculative=spec, kv_cache_memory="8MiB", block_size=4)
    prompts = [REPETITIVE] + PROMPTS[:4]
    ids = [encode(tiny_llama, p) for p in prompts]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=30))
    for prompt_ids, out in zip(ids, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama, prompt_ids, 30)
    stats = llm.engine.stats()
    assert stats.spec_draft_tokens > 0
    # some drafts accepted, some rejected: both paths of the verification ran
    assert stats.spec_accepted_tokens > 0 and stats.spec_acceptance_rate < 1
    assert_all_blocks_free(llm.engine)
    if method == "draft":
        llm.engine.proposer.block_manager.check_invariants([])


def _next_token_probs(path, ids: list[int], temperature: float) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_model(str(path))(torch.tensor([ids])).logits[0, -1].float()
    return torch.softmax(logits / temperature, dim=-1)


def test_sampled_output_follows_the_target_with_a_draft_model(tiny_llama, tiny_draft):
    """Joint law of the first two output tokens with temperature 1.5: the second one goes
    through rejection sampling every time (one draft per step)."""
    temperature, n = 1.5, 2000
    llm = LLM(str(tiny_llama), kv_cache_memory="16MiB", max_num_seqs=256,
              max_num_batched_tokens=4096, seed=11,
              speculative={"method": "draft", "draft_model": str(tiny_draft),
                           "num_speculative_tokens": 1})
    prompt = encode(tiny_llama, "The file")
    outs = llm.generate([prompt] * n, SamplingParams(temperature=temperature, max_tokens=3,
                                                     ignore_eos=True))
    assert llm.engine.stats().spec_accepted_tokens > 0
    pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outs]
    p1 = _next_token_probs(tiny_llama, prompt, temperature)
    top_first = p1.topk(6).indices.tolist()
    keys, target, draft_law = [], [], []
    for t1 in top_first:
        p2 = _next_token_probs(tiny_llama, prompt + [t1], temperature)
        q2 = _next_token_probs(tiny_draft, prompt + [t1], temperature)
        for t2 in p2.topk(12).indices.tolist():
            keys.append((t1, t2))
            target.append(float(p1[t1] * p2[t2]))
            draft_law.append(float(p1[t1] * q2[t2]))
    index = {k: i for i, k in enumerate(keys)}
    observed = torch.zeros(len(keys) + 1)
    for pair in pairs:
        observed[index.get(pair, len(keys))] += 1
    expected = torch.tensor(target + [1 - sum(target)]) * n
    assert chi2_pvalue(observed, expected) > 1e-3
    # power: the draft model's own conditional law is rejected
    wrong = torch.tensor(draft_law + [max(1 - sum(draft_law), 0.0)]) * n
    assert chi2_pvalue(observed, wrong) < 1e-6
    assert_all_blocks_free(llm.engine)
