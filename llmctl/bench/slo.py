"""Percentile SLOs, the pass/fail rule of ``llmctl bench --find-capacity``.

``--slo`` takes one of two forms, never both in one invocation:

- per-request (vLLM's goodput SLOs): ``ttft_ms=500`` bounds each request; the run reports
  ``request_goodput``, the completed requests meeting every bound per second;
- percentile bounds: ``p95_ttft_ms<=500,p95_tpot_ms<=100`` (STAT_METRIC_ms<=MS with STAT
  ``p<P>``, ``median`` or ``mean``, METRIC ``ttft``, ``tpot`` or ``e2el``), for
  ``--find-capacity``. Their per-request parts (``ttft_ms=500``, ``tpot_ms=100``; the
  tighter one when a metric is bounded twice) are the goodput SLOs of the same run.

A level meets ``pP_x_ms<=L`` when at least P% of its requests (failed ones included, as
misses) had x <= L ms: the goodput reading of the bound. On completed requests alone
that is the nearest-rank P-th percentile being <= L; counting failures as misses keeps
a level whose requests error out from passing on the few that finished. ``median`` is
p50. A ``mean`` bound compares the mean over completed requests (as the report's
``mean_*_ms``); failures do not enter it, so pair it with a percentile bound.

ITL has no per-request value (its samples are pooled gaps), so it cannot be bounded
here; ``--gate p99_itl_ms<=50`` checks it on a single run.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from llmctl.bench.metrics import SLO_KEYS, parse_slos, percentile_key, slo_measures
from llmctl.bench.records import RequestRecord
from llmctl.errors import UsageError

METRICS = tuple(SLO_KEYS.values())  # ttft, tpot, e2el
EXAMPLE = "--slo 'p95_ttft_ms<=500,p95_tpot_ms<=100'"
_BOUND = re.compile(r"^(?P<stat>mean|median|p(?P<p>\d+(?:\.\d+)?))_(?P<metric>[a-z0-9]+?)"
                    r"(?:_ms)?\s*<=\s*(?P<limit>\S+)$")


@dataclass(frozen=True)
class SloBound:
    metric: str  # ttft | tpot | e2el
    limit_ms: float
    percentile: float | None  # None: a bound on the mean; median is 50

    @property
    def key(self) -> str:
        """The report's flat key of this statistic (``p95_ttft_ms``, ``mean_tpot_ms``)."""
        stat = "mean" if self.percentile is None else (
            "median" if self.percentile == 50 else percentile_key(self.percentile))
        return f"{stat}_{self.metric}_ms"

    @property
    def text(self) -> str:
        return f"{self.key}<={self.limit_ms:g}"


@dataclass(frozen=True)
class SloFlags:
    """What ``--slo`` said: per-request goodput SLOs and, in the percentile form, bounds."""

    per_request: dict[str, float]
    bounds: tuple[SloBound, ...] = ()


@dataclass(frozen=True)
class BoundCheck:
    bound: SloBound
    value_ms: float | None  # the statistic over completed requests (None: none completed)
    attained: float | None  # fraction of requests meeting the limit (None for a mean bound)
    passed: bool

    def to_dict(self) -> dict:
        return {"slo": self.bound.text, "value_ms": self.value_ms, "attained": self.attained,
                "passed": self.passed}


def _bad(text: str, why: str) -> UsageError:
    return UsageError(f"cannot read SLO {text!r}: {why}",
                      f"write STAT_METRIC_ms<=MILLISECONDS with STAT mean, median or p50..p99.9 "
                      f"and METRIC {', '.join(METRICS)}, e.g. {EXAMPLE}")


def parse_bound(text: str) -> SloBound:
    match = _BOUND.match(text.strip())
    if not match:
        raise _bad(text, "not STAT_METRIC_ms<=MILLISECONDS")
    if match["metric"] not in METRICS:
        raise _bad(text, f"no per-request {match['metric']!r} to bound")
    try:
        limit = float(match["limit"])
    except ValueError:
        limit = float("nan")
    if not limit > 0 or limit == float("inf"):
        raise _bad(text, "the bound must be a positive number of milliseconds")
    if match["stat"] == "mean":
        percentile = None
    elif match["stat"] == "median":
        percentile = 50.0
    else:
        percentile = float(match["p"])
        if not 0 < percentile <= 100:
            raise _bad(text, "the percentile must be in (0, 100]")
    return SloBound(match["metric"], limit, percentile)


def parse_slo_flags(texts: Iterable[str] | None) -> SloFlags:
    """``--slo`` values (repeatable, each possibly comma-separated) in either form."""
    texts = [t for t in texts or () if t.strip()]
    bounded = [t for t in texts if "<" in t or ">" in t]
    plain = [t for t in texts if t not in bounded]
    if bounded and plain:
        raise UsageError(f"--slo mixes a per-request SLO ({plain[0]!r}) with percentile "
                         f"bounds ({bounded[0]!r})",
                         f"use one form: ttft_ms=500 (per-request goodput) or {EXAMPLE} "
                         "(percentile bounds, whose limits also define goodput)")
    if not bounded:
        return SloFlags(parse_slos(texts))
    items = [item for text in bounded for item in text.split(",") if item.strip()]
    for item in items:
        if ">" in item:
            raise _bad(item, "latency bounds are upper limits: write <=")
    bounds = [parse_bound(item) for item in items]
    seen: dict[str, SloBound] = {}
    for b in bounds:
        if b.key in seen:
            raise UsageError(f"--slo bounds {b.key} twice ({seen[b.key].text}, {b.text})",
                             "keep one bound per statistic")
        seen[b.key] = b
    per_request: dict[str, float] = {}
    for b in bounds:
        key = f"{b.metric}_ms"
        per_request[key] = min(per_request.get(key, b.limit_ms), b.limit_ms)
    return SloFlags(per_request, tuple(bounds))


def attainment(records: Sequence[RequestRecord], metric: str, limit_ms: float) -> float:
    """Fraction of ``records`` (failed ones are misses) whose ``metric`` <= ``limit_ms``."""
    if not records:
        return 0.0
    met = 0
    for r in records:
        value = slo_measures(r)[metric] if r.success else None
        met += value is not None and value * 1000.0 <= limit_ms
    return met / len(records)


def check_level(bounds: Sequence[SloBound], records: Sequence[RequestRecord],
                metrics: dict) -> list[BoundCheck]:
    """Every bound on one level's run; ``metrics`` is its ``compute_metrics`` result
    (computed with the bounds' percentiles), where the reported statistic comes from."""
    checks = []
    for b in bounds:
        value = metrics.get(b.key)
        if b.percentile is None:
            checks.append(BoundCheck(b, value, None, value is not None and value <= b.limit_ms))
        else:
            share = attainment(records, b.metric, b.limit_ms)
            # 1e-9: 19 of 20 requests is 0.95 exactly, not 0.9499999.
            checks.append(BoundCheck(b, value, share, share + 1e-9 >= b.percentile / 100.0))
    return checks


def misses_allowed(percentile: float, n: int) -> int:
    """How many of ``n`` requests may miss a ``p<percentile>`` bound with the level still
    passing: below ``100 / (100 - P)`` requests (20 for p95) none may, and one request
    the machine stalls decides the level."""
    return int(n * (1.0 - percentile / 100.0) + 1e-9)


def percentiles_needed(bounds: Sequence[SloBound]) -> list[float]:
    return sorted({b.percentile for b in bounds if b.percentile is not None})
