"""The pure statistics: coarse KLD against full KLD, llama.cpp's formulas by hand."""

import math

import numpy as np
import pytest

from llmctl.eval.metrics import (
    CandidateRows,
    PositionStats,
    ReferenceRows,
    coarse_kld,
    comparison_summary,
    dense_position_stats,
    log_softmax,
    mean_and_se,
    perplexity_summary,
    position_stats,
)


def _log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _split(lp, k):
    """Reference top-k (descending) and the log of the remaining mass."""
    order = np.argsort(-lp, axis=1)[:, :k]
    top = np.take_along_axis(lp, order, 1)
    rest = np.ones_like(lp, dtype=bool)
    np.put_along_axis(rest, order, False, 1)
    with np.errstate(divide="ignore"):
        tail = np.log(np.where(rest, np.exp(lp), 0).sum(1))
    return order, top, tail


@pytest.fixture
def pq():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (50, 200))
    p = _log_softmax(logits)
    q = _log_softmax(logits + rng.normal(0, 0.5, logits.shape))
    full = (np.exp(p) * (p - q)).sum(1)
    return p, q, full


def test_coarse_kld_is_exact_when_k_covers_the_vocabulary(pq):
    p, q, full = pq
    ids, top, tail = _split(p, 200)
    got = coarse_kld(top, tail, np.take_along_axis(q, ids, 1), np.full(len(p), -np.inf))
    np.testing.assert_allclose(got, full, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("k", [1, 8, 64])
def test_coarse_kld_is_a_lower_bound_that_tightens_with_k(pq, k):
    p, q, full = pq
    ids, top, tail = _split(p, k)
    q_at = np.take_along_axis(q, ids, 1)
    q_rest = np.log(1 - np.exp(q_at).sum(1))
    got = coarse_kld(top, tail, q_at, q_rest)
    assert np.all(got <= full + 1e-12) and np.all(got >= -1e-12)
    if k == 64:  # 64 of 200 tokens hold most of the mass here: within 15% of the full KL
        assert got.mean() == pytest.approx(full.mean(), rel=0.15)


def test_unknown_candidate_tokens_join_the_lumped_bucket(pq):
    p, q, full = pq
    ids, top, tail = _split(p, 16)
    q_at = np.take_along_axis(q, ids, 1)
    partial = q_at.copy()
    partial[:, 8:] = np.nan  # the candidate reported only some of the reference's top tokens
    got = coarse_kld(top, tail, partial)  # q_rest derived as 1 - sum(known)
    p8_ids, p8_top, p8_tail = _split(p, 8)
    expected = coarse_kld(p8_top, p8_tail, np.take_along_axis(q, p8_ids, 1))
    np.testing.assert_allclose(got, expected, rtol=1e-9)
    assert np.all(got <= full + 1e-12)


def test_kld_of_identical_distributions_is_zero(pq):
    p, _, _ = pq
    _, top, tail = _split(p, 10)
    got = coarse_kld(top, tail, top.copy(), tail.copy())
    assert np.abs(got).max() < 1e-12


def test_mean_and_se_match_the_llama_cpp_formula():
    x = np.arange(20, dtype=float)
    mean, se = mean_and_se(x)
    assert mean == 9.5
    assert se == pytest.approx(math.sqrt((np.mean(x**2) - 9.5**2) / 19))
    assert mean_and_se(np.arange(10.0))[1] == 0.0  # N <= 10: llama.cpp reports no error


def test_perplexity_summary():
    nll = np.array([1.0, 2.0, 3.0] * 5)
    s = perplexity_summary(nll)
    assert s["ppl"] == pytest.approx(math.exp(2.0))
    assert s["ppl_se"] == pytest.approx(math.exp(2.0) * math.sqrt((14 / 3 - 4) / 14))
    assert s["tokens_scored"] == 15


def test_comparison_summary_by_hand():
    rng = np.random.default_rng(1)
    n = 400
    nll_ref = rng.gamma(2.0, 1.0, n)
    nll = nll_ref + rng.normal(0.05, 0.1, n)
    kld = rng.gamma(1.0, 0.01, n)
    same = rng.random(n) < 0.9
    dp = np.exp(-nll) - np.exp(-nll_ref)
    s = comparison_summary(PositionStats(nll, nll_ref, kld, dp, same))
    assert s["ln_ppl_ratio"] == pytest.approx(nll.mean() - nll_ref.mean())
    # The ratio's error: the standard error of the mean per-token difference.
    assert s["ln_ppl_ratio_se"] == pytest.approx(np.std(nll - nll_ref) / math.sqrt(n - 1), rel=1e-6)
    assert s["ppl_ratio"] == pytest.approx(math.exp(s["ln_ppl_ratio"]))
    assert s["mean_kld"] == pytest.approx(kld.mean())
    assert s["median_kld"] == pytest.approx(np.median(kld))
    assert s["p99_kld"] == pytest.approx(np.sort(kld)[int(0.99 * (n - 1))] * (1 - (0.99 * (n - 1)) % 1)
                                         + np.sort(kld)[int(0.99 * (n - 1)) + 1] * ((0.99 * (n - 1)) % 1))
    assert s["max_kld"] == kld.max() and s["min_kld"] == kld.min()
    assert s["same_top_p"] == pytest.approx(same.mean())
    assert s["same_top_p_se"] == pytest.approx(math.sqrt(same.mean() * (1 - same.mean()) / (n - 1)))
    assert s["rms_dp"] == pytest.approx(math.sqrt(np.mean(dp**2)))
    assert s["mean_dp"] == pytest.approx(dp.mean())


def test_position_stats_from_rows():
    ref = ReferenceRows(top_ids=np.array([[3, 1], [0, 2]]),
                        top_logprobs=np.log(np.array([[0.6, 0.3], [0.5, 0.4]])),
                        tail_logprob=np.log(np.array([0.1, 0.1])),
                        target_logprob=np.log(np.array([0.3, 0.5])))
    cand = CandidateRows(target_logprob=np.log(np.array([0.2, 0.5])), top1=np.array([3, 2]),
                         at_reference=np.log(np.array([[0.7, 0.2], [0.4, 0.5]])),
                         rest_logprob=np.log(np.array([0.1, 0.1])))
    st = position_stats(ref, cand)
    assert st.same_top.tolist() == [True, False]
    np.testing.assert_allclose(st.p_diff, [-0.1, 0.0], atol=1e-12)
    expected0 = 0.6 * math.log(0.6 / 0.7) + 0.3 * math.log(0.3 / 0.2)
    assert st.kld[0] == pytest.approx(expected0)


def test_dense_position_stats_from_full_logits_by_hand():
    """Both models' full rows (the GGUF-vs-float comparisons): exact KL, NLLs, Δp, top-1."""
    rng = np.random.default_rng(2)
    ref = rng.normal(0, 3, (30, 50)).astype(np.float32)
    cand = ref + rng.normal(0, 0.5, ref.shape).astype(np.float32)
    targets = rng.integers(0, 50, 30)
    st = dense_position_stats(ref, cand, targets)
    p, q = _log_softmax(ref.astype(np.float64)), _log_softmax(cand.astype(np.float64))
    rows = np.arange(30)
    np.testing.assert_allclose(st.kld, (np.exp(p) * (p - q)).sum(1), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(st.nll, -q[rows, targets], rtol=1e-12)
    np.testing.assert_allclose(st.nll_ref, -p[rows, targets], rtol=1e-12)
    np.testing.assert_allclose(st.p_diff, np.exp(q[rows, targets]) - np.exp(p[rows, targets]),
                               atol=1e-15)
    assert st.same_top.tolist() == (ref.argmax(1) == cand.argmax(1)).tolist()
    assert 0 < st.same_top.mean() < 1  # the noise flips some argmaxes: both outcomes seen
    # the same rows through the top-k path with k = vocabulary give the same numbers
    ids, top, tail = _split(p, 50)
    coarse = position_stats(
        ReferenceRows(ids, top, tail, p[rows, targets]),
        CandidateRows(q[rows, targets], q.argmax(1), np.take_along_axis(q, ids, 1),
                      np.full(30, -np.inf)))
    for field in ("nll", "nll_ref", "kld", "p_diff", "same_top"):
        np.testing.assert_allclose(getattr(st, field), getattr(coarse, field), atol=1e-12)


def test_dense_stats_of_a_model_against_itself():
    logits = np.random.default_rng(3).normal(0, 2, (8, 20))
    s = comparison_summary(dense_position_stats(logits, logits.copy(), np.arange(8)))
    assert s["max_kld"] < 1e-12 and s["same_top_p"] == 1.0 and s["ppl"] == s["ref_ppl"]


def test_log_softmax_is_stable_for_large_logits():
    lp = log_softmax(np.array([[1000.0, 1000.0, -np.inf], [0.0, 0.0, 0.0]]))
    want = [[math.log(0.5), math.log(0.5), -np.inf], [-math.log(3)] * 3]
    np.testing.assert_allclose(lp, want, atol=1e-15)
