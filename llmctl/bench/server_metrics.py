"""Server-side counters from a Prometheus ``/metrics`` page, scraped before and after.

Names are vLLM's (``vllm:x``); llmctl's server uses the same names with the ``llmctl:``
prefix. Counters are compared as after - before; gauges (KV-cache usage) are also
sampled while the run goes, for their peak. A server without ``/metrics`` simply gives
``{"available": false}``.
"""

from __future__ import annotations

import math
import re

PREFIXES = ("vllm:", "llmctl:")
# summary key -> metric base name (without prefix / ``_total``), for counters.
COUNTERS = {
    "num_preemptions": "num_preemptions",
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "spec_decode_num_draft_tokens": "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "spec_decode_num_accepted_tokens",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    # llmctl serve's supervisor (llmctl.serve.proc): a restart during a run is a finding
    "engine_restarts": "engine_restarts",
    # llmctl serve's engine meter (llmctl.perf.meter): FLOPs, bytes, busy seconds by phase
    **{f"{phase}_{field}": f"{phase}_{field}" for phase in ("prefill", "decode")
       for field in ("flops", "bytes", "busy_seconds")},
}
# gauges: base names in order of preference (vLLM renamed gpu_cache_usage_perc in v1).
GAUGES = {
    "kv_cache_usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
}
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+"
                     r"(?P<value>\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """``{metric name: value summed over label sets}`` from the text exposition format.

    Histogram/summary series (``_bucket``, ``_sum``, ``_count``) are kept by their full
    names; label sets (per model, per finish reason) are summed.
    """
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        name = match["name"]
        if name.endswith("_bucket"):
            continue
        values[name] = values.get(name, 0.0) + value
    return values


def _lookup(values: dict[str, float], base: str) -> float | None:
    for prefix in PREFIXES:
        for suffix in ("_total", ""):
            if (key := f"{prefix}{base}{suffix}") in values:
                return values[key]
    return None


def gauges(values: dict[str, float]) -> dict[str, float | None]:
    out = {}
    for key, bases in GAUGES.items():
        out[key] = next((v for b in bases if (v := _lookup(values, b)) is not None), None)
    return out


def summarize(before: dict[str, float] | None, after: dict[str, float] | None,
              samples: list[dict[str, float]] | None = None) -> dict:
    """Deltas of the counters, peaks of the gauges, and the rates derived from them."""
    if before is None or after is None:
        return {"available": False}
    summary: dict = {"available": True}
    for key, base in COUNTERS.items():
        a, b = _lookup(before, base), _lookup(after, base)
        summary[key] = None if a is None or b is None else b - a
    after_gauges = gauges(after)
    summary["kv_cache_usage_after"] = after_gauges["kv_cache_usage"]
    observed = [gauges(s)["kv_cache_usage"] for s in [before, *(samples or []), after]]
    observed = [v for v in observed if v is not None]
    summary["kv_cache_usage_peak"] = max(observed) if observed else None
    running = [gauges(s)["num_requests_running"] for s in samples or []]
    running = [v for v in running if v is not None]
    summary["num_requests_running_peak"] = max(running) if running else None
    queries, hits = summary["prefix_cache_queries"], summary["prefix_cache_hits"]
    summary["prefix_cache_hit_rate"] = hits / queries if queries and hits is not None else None
    drafts, accepted = (summary["spec_decode_num_draft_tokens"],
                        summary["spec_decode_num_accepted_tokens"])
    summary["spec_decode_acceptance_rate"] = (accepted / drafts if drafts and accepted
                                              is not None else None)
    summary["samples"] = len(samples or [])
    return summary


def flat(summary: dict) -> dict[str, float]:
    """``server_*`` keys for the report's flat metrics (and so for ``--gate``)."""
    return {f"server_{k}": v for k, v in summary.items()
            if k not in ("available", "samples") and isinstance(v, (int, float))}


async def scrape(client, base_url: str) -> dict[str, float] | None:
    """One scrape; ``None`` when the server has no ``/metrics`` or is unreachable."""
    import httpx

    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    values = parse_prometheus(resp.text)
    return values if any(k.startswith(PREFIXES) for k in values) else None
