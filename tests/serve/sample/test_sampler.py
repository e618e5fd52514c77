"""Sampler units: filters and penalties against transformers' processors, draws against
their distribution, seeds, logprobs."""

from __future__ import annotations

import pytest
import torch

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.core.sequence import Request
from llmctl.serve.sample.sampler import (
    Sampler,
    apply_penalties,
    exponential_race,
    filter_logits,
    generator_for,
)

torch.manual_seed(0)
LOGITS = torch.randn(6, 50) * 3


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square test; bins expecting < 5 draws are pooled."""
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep].double(), exp[keep].double()
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = max(int(keep.sum()) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def make_seq(prompt, output=(), **params):
    req = Request("r", list(prompt), SamplingParams(**params), prompt=None, priority=0,
                  arrival_time=0.0, eos_token_ids=frozenset())
    seq = req.seqs[0]
    seq.token_ids.extend(output)
    return seq


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.1),
                                               (8, 0.9, 0.05)])
def test_filters_match_transformers_warpers(top_k, top_p, min_p):
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    want = LOGITS.clone()
    if top_k:
        want = TopKLogitsWarper(top_k)(None, want)
    if top_p < 1:
        want = TopPLogitsWarper(top_p)(None, want)
    if min_p:
        want = MinPLogitsWarper(min_p)(None, want)
    rows = LOGITS.shape[0]
    got = filter_logits(LOGITS.clone(), torch.full((rows,), top_k), torch.full((rows,), top_p),
                        torch.full((rows,), min_p))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], want[~torch.isinf(want)])


def test_filters_are_per_row():
    got = filter_logits(LOGITS[:2].clone(), torch.tensor([1, 0]), torch.tensor([1.0, 1.0]),
                        torch.tensor([0.0, 0.0]))
    assert int(torch.isfinite(got[0]).sum()) == 1 and bool(torch.isfinite(got[1]).all())


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    prompt, output = [1, 2, 3, 2], [7, 7, 9]
    processor = RepetitionPenaltyLogitsProcessor(1.3)
    want = processor(torch.tensor([prompt + output]), LOGITS[:1].clone())
    got = apply_penalties(LOGITS[:1].clone(), [prompt], [output], torch.tensor([1.3]),
                          torch.tensor([0.0]), torch.tensor([0.0]))
    torch.testing.assert_close(got, want)


def test_presence_and_frequency_penalties_count_output_only():
    got = apply_penalties(LOGITS[:1].clone(), [[4, 4]], [[7, 7, 9]], torch.tensor([1.0]),
                          torch.tensor([0.5]), torch.tensor([0.25]))
    diff = (LOGITS[0] - got[0])
    assert diff[7].item() == pytest.approx(0.5 + 2 * 0.25)
    assert diff[9].item() == pytest.approx(0.5 + 0.25)
    assert diff[4].item() == 0.0 and float(diff.abs().sum()) == pytest.approx(1.75)


def test_exponential_race_draws_from_the_distribution():
    probs = torch.softmax(torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0]), dim=0)
    n = 20000
    gen = torch.Generator().manual_seed(5)
    draws = exponential_race(probs.expand(n, -1).contiguous(), [None] * n, gen)
    counts = torch.bincount(draws, minlength=6).float()
    assert chi2_pvalue(counts, probs * n) > 1e-3
    # and the test notices a wrong distribution
    assert chi2_pvalue(counts, torch.full((6,), n / 6)) < 1e-6


def test_temperature_and_greedy_rows_in_one_batch():
    sampler = Sampler(seed=0)
    seqs = [make_seq([1], temperature=0.0), make_seq([1], temperature=5.0, seed=3)]
    logits = LOGITS[:2].clone()
    tokens = [sampler.sample(logits, seqs) for _ in range(50)]
    assert {t[0] for t in tokens} == {int(LOGITS[0].argmax())}
    assert len({t[1] for t in tokens}) > 5  # a hot temperature spreads the draws


def test_seeded_rows_repeat_whatever_else_is_drawn():
    a = Sampler(seed=0)
    b = Sampler(seed=99)
    s1 = make_seq([1], seed=42)
    s2 = make_seq([1], seed=42)
    first = [a.sample(LOGITS[:1], [s1])[0] for _ in range(10)]
    noise = make_seq([1])
    batch = torch.stack([LOGITS[1], LOGITS[0]])
    second = [b.sample(batch, [noise, s2])[1] for _ in range(10)]
    assert first == second
    assert generator_for(make_seq([1])) is None


def test_penalties_change_greedy_choice():
    sampler = Sampler()
    top = int(LOGITS[0].argmax())
    plain = make_seq([1], output=[top], temperature=0.0)
    penalised = make_seq([1], output=[top] * 3, temperature=0.0, frequency_penalty=2.0)
    assert sampler.sample(LOGITS[:1], [plain]) == [top]
    assert sampler.sample(LOGITS[:1], [penalised]) != [top]


def test_logprobs_are_raw_log_softmax_with_top_n():
    out = Sampler.logprobs(LOGITS[:2], [3, 4], [2, 0])
    logp = torch.log_softmax(LOGITS[:2], dim=-1)
    assert out[0].logprob == pytest.approx(float(logp[0, 3]))
    assert [t for t, _ in out[0].top] == logp[0].topk(2).indices.tolist()
    assert out[1].top == []


def test_logprobs_top_n_past_the_vocabulary_gives_the_whole_vocabulary():
    out = Sampler.logprobs(LOGITS[:1, :8], [3], [20])
    assert sorted(t for t, _ in out[0].top) == list(range(8))


@pytest.mark.parametrize("field,value,needle", [
    ("top_p", 0.0, "top_p: Input should be greater than 0"),  # 0 is refused, not "off"
    ("top_p", float("nan"), "top_p: Input should be a finite number"),
    ("temperature", float("inf"), "temperature: Input should be a finite number"),
    ("presence_penalty", float("nan"), "presence_penalty: Input should be a finite number"),
    ("seed", 2**64, "seed: Input should be less than or equal to 18446744073709551615"),
    ("seed", -(2**63) - 1, "seed: Input should be greater than or equal to"),
    ("top_k", 2**63, "top_k: Input should be less than or equal to 9223372036854775807"),
])
def test_sampling_params_refuse_what_the_sampler_cannot_take(field, value, needle):
    from llmctl.errors import UsageError

    with pytest.raises(UsageError, match=needle):
        SamplingParams(**{field: value})


def test_every_64_bit_seed_is_read_as_torch_reads_it():
    """Signed or unsigned 64-bit: a negative seed is seed + 2**64 (torch.manual_seed's
    reading), and completion i's seed + i wraps the same way instead of overflowing."""
    def draws(seed: int, index: int = 0) -> list[float]:
        seq = make_seq([1], seed=seed, n=2)
        seq.index = index
        return torch.rand(4, generator=generator_for(seq)).tolist()

    def torch_draws(seed: int) -> list[float]:
        return torch.rand(4, generator=torch.Generator().manual_seed(seed)).tolist()

    assert draws(-1) == torch_draws(2**64 - 1) == torch_draws(-1)
    assert draws(-(2**63)) == torch_draws(2**63)
    assert draws(2**64 - 1, index=1) == torch_draws(0)
    assert draws(5, index=1) == torch_draws(6)
