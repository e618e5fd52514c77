"""Perplexity and distribution-match statistics: arrays in, numbers out.

Definitions follow llama.cpp's ``llama-perplexity --kl-divergence``
(tools/perplexity/perplexity.cpp), so numbers can be compared with it:

- ``ppl = exp(mean NLL)`` over scored tokens; its error is ``ppl * se(NLL)`` with
  ``se = sqrt((E[x^2] - E[x]^2) / (N - 1))`` (llama.cpp reports 0 when N <= 10).
  Tokens are treated as independent, which understates the error a little
  (neighbouring tokens are correlated).
- ``ln_ppl_ratio = mean(NLL_cand) - mean(NLL_ref)``, error
  ``sqrt(se_c^2 + se_r^2 - 2 cov)``; ``ppl_ratio = exp(ln_ppl_ratio)``, error ``ratio * se``.
- ``Δp = p_cand(actual token) - p_ref(actual token)`` per token: mean, RMS, percentiles.
- ``same_top_p``: fraction of tokens where both models rank the same token first,
  error ``sqrt(p (1 - p) / (N - 1))``.
- KL divergence ``KL(P_ref || Q_cand)`` per token: mean, median, percentiles, max.

KL over a coarsened support. The reference store keeps only the top-k reference
log-probs per token and the log of the remaining mass (the *tail*). KL is computed
over the partition {each top-k token} + {everything else, lumped}:

    KL_k = sum_{i in top-k} p_i log(p_i / q_i) + p_tail log(p_tail / q_tail)

By the log-sum inequality grouping can only lose divergence, so ``KL_k <= KL`` and
the gap is ``p_tail * KL(P|tail || Q|tail)``. On SmolLM2 (49k vocabulary, held-out
prose) the top 64 tokens hold 91 % of the reference's mass and the coarse KL is
83-86 % of the full one, for int8 and int4 candidates alike (results/eval-kld-topk.md):
a consistent scale factor, so rankings and gates hold; raise ``--top-k`` to tighten
it (k = 128: 88-90 %). When a
candidate only reports some of those tokens (an OpenAI server's top logprobs), the
unknown ones join the lumped bucket on both sides; the result is still a lower bound.
llama.cpp also truncates: it drops reference tokens with log p < -16.

With both models' full logit rows in memory (:func:`dense_position_stats`, for small
comparisons such as a GGUF against its float model in ``tests/gguf``), KL is exact:
``sum_i p_i (log p_i - log q_i)`` over the whole vocabulary, in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Quantiles reported for KLD and Δp (llama.cpp prints the same set).
KLD_QUANTILES = {"max": 1.0, "p999": 0.999, "p99": 0.99, "p95": 0.95, "p90": 0.90,
                 "median": 0.5, "p10": 0.10, "p5": 0.05, "p1": 0.01, "p01": 0.001, "min": 0.0}
DP_QUANTILES = {"max": 1.0, "p999": 0.999, "p99": 0.99, "p95": 0.95, "p90": 0.90, "p75": 0.75,
                "median": 0.5, "p25": 0.25, "p10": 0.10, "p5": 0.05, "p1": 0.01, "p01": 0.001,
                "min": 0.0}
# A server's rounded logprobs can sum past 1; floor the candidate's lumped mass.
_MIN_REST = 1e-10


@dataclass(frozen=True)
class ReferenceRows:
    """Per scored token: the reference's top-k log-probs (descending) and the rest."""

    top_ids: np.ndarray  # [N, k] int
    top_logprobs: np.ndarray  # [N, k] float
    tail_logprob: np.ndarray  # [N] log of the mass outside top_ids (-inf if none)
    target_logprob: np.ndarray  # [N] log p_ref(actual next token)


@dataclass(frozen=True)
class CandidateRows:
    """Per scored token, what a candidate says about the same positions."""

    target_logprob: np.ndarray  # [N] log q(actual next token)
    top1: np.ndarray  # [N] the candidate's most likely token, -1 if unknown
    at_reference: np.ndarray | None = None  # [N, k] log q at the reference's top ids; NaN unknown
    rest_logprob: np.ndarray | None = None  # [N] log q outside the known at_reference ids


@dataclass(frozen=True)
class PositionStats:
    nll: np.ndarray
    nll_ref: np.ndarray
    kld: np.ndarray
    p_diff: np.ndarray
    same_top: np.ndarray  # bool

    @staticmethod
    def concat(parts: list[PositionStats]) -> PositionStats:
        return PositionStats(*(np.concatenate([getattr(p, f) for p in parts])
                               for f in ("nll", "nll_ref", "kld", "p_diff", "same_top")))


def _logsumexp(x: np.ndarray, axis: int = -1) -> np.ndarray:
    top = np.max(x, axis=axis, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return np.log(np.sum(np.exp(x - top), axis=axis)) + np.squeeze(top, axis=axis)


def coarse_kld(p_top: np.ndarray, p_tail: np.ndarray, q_top: np.ndarray,
               q_rest: np.ndarray | None = None) -> np.ndarray:
    """KL(P || Q) per row over {top-k tokens} + one lumped bucket (see module doc).

    ``p_top``/``q_top`` are log-probs at the same token ids ([N, k]; NaN in ``q_top``
    marks a token the candidate did not report). ``p_tail`` is log P(outside top-k);
    ``q_rest`` is log Q(outside the known ids), derived as ``1 - sum`` when None.
    """
    p_top = p_top.astype(np.float64)
    q_top = q_top.astype(np.float64)
    known = ~np.isnan(q_top)
    p = np.exp(p_top)
    with np.errstate(invalid="ignore"):
        inside = np.where(known, p * (p_top - q_top), 0.0).sum(axis=1)
    p_rest = np.exp(p_tail.astype(np.float64)) + np.where(known, 0.0, p).sum(axis=1)
    if q_rest is None:
        q_rest_mass = 1.0 - np.where(known, np.exp(q_top), 0.0).sum(axis=1)
    else:
        q_rest_mass = np.exp(q_rest.astype(np.float64))
    q_rest_mass = np.maximum(q_rest_mass, _MIN_REST)
    with np.errstate(divide="ignore", invalid="ignore"):
        lumped = np.where(p_rest > 0, p_rest * (np.log(p_rest) - np.log(q_rest_mass)), 0.0)
    return inside + lumped


def position_stats(ref: ReferenceRows, cand: CandidateRows) -> PositionStats:
    """Per-token NLLs, KLD, Δp and top-1 agreement for one window's scored rows."""
    nll = -cand.target_logprob.astype(np.float64)
    nll_ref = -ref.target_logprob.astype(np.float64)
    if cand.at_reference is not None:
        kld = coarse_kld(ref.top_logprobs, ref.tail_logprob, cand.at_reference, cand.rest_logprob)
    else:
        kld = np.full(len(nll), np.nan)
    p_diff = np.exp(-nll) - np.exp(-nll_ref)
    same_top = cand.top1 == ref.top_ids[:, 0]
    return PositionStats(nll, nll_ref, kld, p_diff, same_top)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of each row of ``logits``, in float64."""
    x = logits.astype(np.float64)
    return x - _logsumexp(x)[..., None]


def dense_position_stats(reference: np.ndarray, candidate: np.ndarray,
                         targets: np.ndarray) -> PositionStats:
    """:func:`position_stats` from full logit rows ([N, vocab] each; row i scores
    ``targets[i]``), with the exact KL over the whole vocabulary."""
    p, q = log_softmax(reference), log_softmax(candidate)
    rows = np.arange(len(targets))
    nll, nll_ref = -q[rows, targets], -p[rows, targets]
    kld = (np.exp(p) * (p - q)).sum(axis=-1)
    same_top = q.argmax(axis=-1) == p.argmax(axis=-1)  # lowest id on ties, on both sides
    return PositionStats(nll, nll_ref, kld, np.exp(-nll) - np.exp(-nll_ref), same_top)


def mean_and_se(x: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error; the error is 0 for N <= 10 (as llama.cpp)."""
    n = len(x)
    if n == 0:
        return math.nan, math.nan
    mean = float(np.mean(x, dtype=np.float64))
    var = float(np.mean(np.square(x, dtype=np.float64))) - mean * mean
    return mean, math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0


def _covariance_of_means(a: np.ndarray, b: np.ndarray) -> float:
    n = len(a)
    if n < 10:
        return 0.0
    return (float(np.mean(a * b)) - float(np.mean(a)) * float(np.mean(b))) / (n - 1)


def perplexity_summary(nll: np.ndarray) -> dict[str, float]:
    nll = np.asarray(nll, dtype=np.float64)
    mean, se = mean_and_se(nll)
    ppl = math.exp(mean) if math.isfinite(mean) else math.nan
    return {"ppl": ppl, "ppl_se": ppl * se, "nll_mean": mean, "nll_se": se,
            "tokens_scored": len(nll)}


def _quantiles(x: np.ndarray, table: dict[str, float], suffix: str) -> dict[str, float]:
    values = np.quantile(x, list(table.values())) if len(x) else [math.nan] * len(table)
    return {f"{name}_{suffix}": float(v) for name, v in zip(table, values)}


def comparison_summary(stats: PositionStats) -> dict[str, float]:
    """Everything llama.cpp's ``--kl-divergence`` summary prints, as flat keys.

    Δp and same_top_p are fractions (llama.cpp prints percent).
    """
    n = len(stats.nll)
    out: dict[str, float] = {}
    mean_c, se_c = mean_and_se(stats.nll)
    mean_r, se_r = mean_and_se(stats.nll_ref)
    cov = _covariance_of_means(stats.nll, stats.nll_ref)
    ppl, ref_ppl = math.exp(mean_c), math.exp(mean_r)
    out.update(ppl=ppl, ppl_se=ppl * se_c, ref_ppl=ref_ppl, ref_ppl_se=ref_ppl * se_r)
    out["ppl_corr"] = cov / (se_c * se_r) if se_c > 0 and se_r > 0 else math.nan
    ln_ratio = mean_c - mean_r
    ln_ratio_se = math.sqrt(max(se_c * se_c + se_r * se_r - 2 * cov, 0.0))
    out.update(ln_ppl_ratio=ln_ratio, ln_ppl_ratio_se=ln_ratio_se,
               ppl_ratio=math.exp(ln_ratio), ppl_ratio_se=math.exp(ln_ratio) * ln_ratio_se)
    ppl_cov = ppl * ref_ppl * cov
    out.update(ppl_diff=ppl - ref_ppl, ppl_diff_se=math.sqrt(max(
        (ppl * se_c) ** 2 + (ref_ppl * se_r) ** 2 - 2 * ppl_cov, 0.0)))
    if not np.isnan(stats.kld).all():
        out["mean_kld"], out["mean_kld_se"] = mean_and_se(stats.kld)
        out.update(_quantiles(stats.kld, KLD_QUANTILES, "kld"))
    out["mean_dp"], out["mean_dp_se"] = mean_and_se(stats.p_diff)
    out.update(_quantiles(stats.p_diff, DP_QUANTILES, "dp"))
    mse, mse_se = mean_and_se(np.square(stats.p_diff))
    rms = math.sqrt(mse)
    out.update(rms_dp=rms, rms_dp_se=0.5 / rms * mse_se if rms > 0 else 0.0)
    same = float(np.mean(stats.same_top)) if n else math.nan
    out.update(same_top_p=same,
               same_top_p_se=math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0,
               tokens_scored=n)
    return out
