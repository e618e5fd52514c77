"""Every statistic of a run, from its per-request records, in one pure function.

Definitions follow vLLM's ``bench serve`` so numbers line up across tools:

- TTFT: send -> first streamed chunk carrying text (client side).
- ITL: the gaps between later text chunks, pooled over all requests.
- TPOT = (E2E - TTFT) / (output tokens - 1), only for requests with > 1 output token.
  guidellm's ``time_per_output_token_ms`` divides by all output tokens including the
  first: it is not this number.
- E2E (``e2el``): send -> end of the stream.
- Goodput: completed requests meeting every SLO given, per second of the run. A request
  with <= 1 output token has TPOT 0 for the SLO check (as vLLM); one with no token has no
  TTFT, so its E2E latency stands in for it.
- Peak output tokens/s and ``max_concurrent_requests``: one-second buckets from the
  first send, one token per text chunk (as vLLM; a request counts in every second it
  touches). ``peak_concurrency`` is the exact number of requests in flight at once.

Aggregates over completed requests only; an empty list gives ``None``, not 0, so a gate
on a metric nobody measured fails loudly instead of passing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from llmctl.bench.records import RequestRecord
from llmctl.errors import UsageError

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)
LATENCIES = ("ttft", "tpot", "itl", "e2el")
# SLO name -> the per-request latency it bounds (``--slo ttft_ms=500``; vLLM's ``ttft:500``).
SLO_KEYS = {"ttft_ms": "ttft", "tpot_ms": "tpot", "e2el_ms": "e2el"}


def parse_slos(texts: Iterable[str] | None) -> dict[str, float]:
    """``["ttft_ms=500", "tpot:100"]`` -> ``{"ttft_ms": 500.0, "tpot_ms": 100.0}``."""
    slos: dict[str, float] = {}
    for text in texts or ():
        key, sep, value = text.replace(":", "=", 1).partition("=")
        key = key.strip()
        key = key if key.endswith("_ms") else f"{key}_ms"
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not sep or key not in SLO_KEYS or not number > 0:
            raise UsageError(f"cannot read SLO {text!r}",
                             f"write NAME=MILLISECONDS with NAME in {', '.join(SLO_KEYS)}, "
                             "e.g. --slo ttft_ms=500")
        slos[key] = number
    return slos


def percentile_key(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def _stats(name: str, seconds: Sequence[float], percentiles: Sequence[float]) -> dict:
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"] + [
        f"{percentile_key(p)}_{name}_ms" for p in percentiles]
    if not len(seconds):
        return dict.fromkeys(keys)
    ms = np.asarray(seconds, dtype=float) * 1000.0
    values = [ms.mean(), np.median(ms), ms.std()] + [np.percentile(ms, p) for p in percentiles]
    return {k: float(v) for k, v in zip(keys, values)}


def _tpot(r: RequestRecord) -> float | None:
    if r.output_tokens is None or r.output_tokens <= 1 or r.ttft is None or r.latency is None:
        return None
    return (r.latency - r.ttft) / (r.output_tokens - 1)


def slo_measures(r: RequestRecord) -> dict[str, float | None]:
    """A completed request's latencies (seconds) as an SLO judges them: no token -> its
    E2E latency stands in for TTFT; <= 1 token -> TPOT 0 (as vLLM's goodput)."""
    return {"ttft": r.ttft if r.ttft is not None else r.latency,
            "tpot": _tpot(r) or 0.0,
            "e2el": r.latency}


def _is_good(r: RequestRecord, slos: dict[str, float]) -> bool:
    measured = slo_measures(r)
    return all(measured[SLO_KEYS[k]] is not None and measured[SLO_KEYS[k]] * 1000.0 <= limit
               for k, limit in slos.items())


def _peaks(done: list[RequestRecord]) -> tuple[float, int]:
    """Max text chunks in any one-second bucket, and max requests active in a bucket."""
    timed = [r for r in done if r.start is not None and r.latency is not None]
    if not timed:
        return 0.0, 0
    origin = min(r.start for r in timed)
    buckets = math.ceil(max(r.start + r.latency for r in timed) - origin) + 1
    tokens = np.zeros(buckets)
    active = np.zeros(buckets)
    for r in timed:
        if r.ttft is not None:
            times = r.start + r.ttft + np.concatenate(([0.0], np.cumsum(r.itl)))
            idx = np.floor(times - origin).astype(int)
            np.add.at(tokens, idx[(idx >= 0) & (idx < buckets)], 1)
        first, last = int(r.start - origin), int(r.start + r.latency - origin)
        active[first:min(last, buckets - 1) + 1] += 1
    return float(tokens.max()), int(active.max())


def _peak_overlap(done: list[RequestRecord]) -> int:
    """Most requests in flight at one instant (a sweep over start/end events)."""
    events = sorted([(r.start, 1) for r in done if r.start is not None and r.latency is not None]
                    + [(r.start + r.latency, -1) for r in done
                       if r.start is not None and r.latency is not None],
                    key=lambda e: (e[0], e[1]))  # at a tie, an end comes before a start
    peak = active = 0
    for _, step in events:
        active += step
        peak = max(peak, active)
    return peak


def compute_metrics(records: Sequence[RequestRecord], duration: float,
                    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                    slos: dict[str, float] | None = None) -> dict:
    """Flat vLLM-compatible keys (``request_throughput``, ``p99_ttft_ms``, ...)."""
    done = [r for r in records if r.success]
    outputs = [r.output_tokens or 0 for r in done]
    total_in = sum(r.input_tokens for r in done)
    total_out = sum(outputs)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tpots = [t for t in map(_tpot, done) if t is not None]
    itls = [gap for r in done for gap in r.itl]
    e2els = [r.latency for r in done if r.latency is not None]
    peak_tokens, peak_active = _peaks(done)
    result: dict = {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration": float(duration),
        "total_input_tokens": int(total_in),
        "total_output_tokens": int(total_out),
        "request_throughput": per_s(len(done)),
        "request_goodput": per_s(sum(_is_good(r, slos) for r in done)) if slos else None,
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_active,
        "peak_concurrency": _peak_overlap(done),
    }
    for name, values in zip(LATENCIES, (ttfts, tpots, itls, e2els)):
        result.update(_stats(name, values, percentiles))
    return result


def raw_arrays(records: Sequence[RequestRecord]) -> dict[str, list]:
    """Per-request arrays in request order (vLLM's names; times in seconds)."""
    return {
        "input_lens": [r.input_tokens for r in records],
        "output_lens": [r.output_tokens if r.success else 0 for r in records],
        "scheduled_times": [r.scheduled for r in records],
        "start_times": [r.start for r in records],
        "ttfts": [r.ttft for r in records],
        "tpots": [_tpot(r) for r in records],
        "itls": [list(r.itl) for r in records],
        "e2els": [r.latency for r in records],
        "errors": [r.error or "" for r in records],
        "trace_ids": [r.trace_id for r in records],  # W3C trace ids: the server's traces
    }
