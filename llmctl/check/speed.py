"""A confidence interval on the ratio of a speed metric between two sets of rounds.

A speed gate relative to a baseline (``bench.chat.output_throughput>=0.95*baseline``)
must not fail on run-to-run noise nor pass a real regression because one round was
lucky. Each side ran ``repeat`` rounds; speed noise is multiplicative (a busy core slows
everything by a factor), so the interval is built on the log scale:

    d  = mean(log c_i) - mean(log b_j)            ratio = exp(d)
    se = sqrt(s_c² / n_c + s_b² / n_b)            (Welch)
    df = se⁴ / ((s_c²/n_c)² / (n_c - 1) + (s_b²/n_b)² / (n_b - 1))   (Welch–Satterthwaite)
    interval = exp(d ± t_{0.975, ⌊df⌋} · se)

Rounding df down makes t larger: the interval errs wide. When one side has a single
round its variance is unknown; the other side's variance stands in for it (same machine,
same workload: the same noise), with that side's degrees of freedom. With one round on
both sides there is no noise estimate: the interval is the point and ``detectable`` is
None, which the report shows as a warning.

``detectable``: the smallest regression (as a fraction: 0.05 = 5% slower) the interval
can tell from no change, ``1 - exp(-t · se)``: the distance from an unchanged ratio of 1
to its lower bound. A gate whose tolerance (1 - factor) is smaller than that is asking
more of the run than its rounds can show.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from llmctl.stats import Z95

# Student's t, two-sided 95% (the 0.975 quantile), df = 1..30 (standard tables).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: float) -> float:
    """The 0.975 quantile of Student's t at ``⌊df⌋`` degrees of freedom (df >= 1).

    Past the table, the Cornish–Fisher expansion around the normal quantile (error below
    1e-4 from df = 30 on)."""
    k = math.floor(df)
    if k < 1:
        raise ValueError(f"t quantile needs df >= 1, got {df}")
    if k <= len(_T975):
        return _T975[k - 1]
    z = Z95
    return (z + (z ** 3 + z) / (4 * k) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * k ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * k ** 3))


@dataclass(frozen=True)
class RatioInterval:
    ratio: float  # exp(mean log candidate - mean log baseline)
    low: float
    high: float
    n_candidate: int
    n_baseline: int
    df: float | None  # None: one round each, no noise estimate
    detectable: float | None  # smallest regression the rounds can show (fraction)

    def to_dict(self) -> dict:
        return {"ratio": self.ratio, "low": self.low, "high": self.high,
                "n_candidate": self.n_candidate, "n_baseline": self.n_baseline,
                "df": self.df, "detectable": self.detectable}


def _logs(values: Sequence[float], side: str) -> list[float]:
    if not values:
        raise ValueError(f"no {side} rounds")
    if any(not (v > 0 and math.isfinite(v)) for v in values):
        raise ValueError(f"{side} rounds must be positive and finite, got {list(values)}")
    return [math.log(v) for v in values]


def ratio_interval(candidate: Sequence[float], baseline: Sequence[float]) -> RatioInterval:
    """The 95% interval of candidate / baseline from each side's rounds (see module doc)."""
    lc, lb = _logs(candidate, "candidate"), _logs(baseline, "baseline")
    nc, nb = len(lc), len(lb)
    d = statistics.fmean(lc) - statistics.fmean(lb)
    vc = statistics.variance(lc) if nc > 1 else None
    vb = statistics.variance(lb) if nb > 1 else None
    if vc is None and vb is None:
        ratio = math.exp(d)
        return RatioInterval(ratio, ratio, ratio, nc, nb, None, None)
    if vc is None or vb is None:  # one side's noise stands in for the other's
        v, df = (vb, nb - 1) if vc is None else (vc, nc - 1)
        se = math.sqrt(v / nc + v / nb)
    else:
        a, b = vc / nc, vb / nb
        se = math.sqrt(a + b)
        df = (a + b) ** 2 / (a * a / (nc - 1) + b * b / (nb - 1)) if a + b > 0 else nc + nb - 2
    t = t975(max(df, 1))
    return RatioInterval(math.exp(d), math.exp(d - t * se), math.exp(d + t * se), nc, nb,
                         df, 1 - math.exp(-t * se))
