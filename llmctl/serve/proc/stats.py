"""One stats snapshot for the server from its replicas' snapshots.

Counts add up (requests, tokens, blocks, steps, seconds); ratios are recomputed from the
summed counts they are ratios of, never averaged (an idle replica's 0 % hit rate must not
halve a busy one's). Utilization: FLOPs and bytes add up; busy seconds do not, because
replicas run at the same time on their own cores and the peak is the whole machine's, so
the window's busy time is the longest replica's (work/max-busy, a lower bound on the
machine's rate while any replica worked). Deadline admission sees one queue served at
the replicas' summed rate.
"""

from __future__ import annotations

from llmctl.perf.utilization import PhaseLoad
from llmctl.serve.core.admission import ServiceRate

# summed as plain numbers
_SUMS = ("num_running", "num_waiting", "kv_cache_blocks", "kv_cache_tokens",
         "kv_slots_allocated", "kv_slots_used", "prefix_cache_queried_tokens",
         "prefix_cache_hit_tokens", "num_preemptions", "prompt_tokens", "generation_tokens",
         "cached_prompt_tokens", "num_requests_finished", "num_steps", "spec_draft_tokens",
         "spec_accepted_tokens", "spec_verify_steps")


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def _loads(parts: list[dict[str, PhaseLoad]], busy_is_max: bool) -> dict[str, PhaseLoad]:
    out: dict[str, PhaseLoad] = {}
    for part in parts:
        for phase, load in part.items():
            have = out.get(phase)
            if have is None:
                out[phase] = load
                continue
            seconds = (max(have.seconds, load.seconds) if busy_is_max
                       else have.seconds + load.seconds)
            out[phase] = PhaseLoad(have.flops + load.flops, have.bytes + load.bytes, seconds)
    return out


def _rate(rates: list[ServiceRate]) -> ServiceRate | None:
    if not rates:
        return None
    n = len(rates)
    return ServiceRate(tokens_per_second=sum(r.tokens_per_second for r in rates),
                       seconds_per_step=sum(r.seconds_per_step for r in rates) / n,
                       output_fraction=sum(r.output_fraction for r in rates) / n)


def merge_stats(snapshots: list[dict]) -> dict:
    """The server's snapshot (one replica's is returned as is)."""
    snapshots = [s for s in snapshots if s]
    if len(snapshots) <= 1:
        return dict(snapshots[0]) if snapshots else {}
    out = {key: sum(s.get(key, 0) for s in snapshots) for key in _SUMS}
    out["kv_cache_usage"] = _ratio(sum(s.get("kv_cache_usage", 0.0) * s.get("kv_cache_blocks", 0)
                                       for s in snapshots), out["kv_cache_blocks"])
    out["prefix_cache_hit_rate"] = _ratio(out["prefix_cache_hit_tokens"],
                                          out["prefix_cache_queried_tokens"])
    out["spec_acceptance_rate"] = _ratio(out["spec_accepted_tokens"], out["spec_draft_tokens"])
    out["spec_mean_accepted_per_step"] = _ratio(out["spec_accepted_tokens"],
                                                out["spec_verify_steps"])
    phases: dict[str, float] = {}
    for s in snapshots:
        for phase, seconds in (s.get("step_phase_seconds") or {}).items():
            phases[phase] = phases.get(phase, 0.0) + seconds
    out["step_phase_seconds"] = phases
    # totals since start are counters of work done: seconds add (engine-seconds)
    out["perf_totals"] = _loads([s.get("perf_totals") or {} for s in snapshots], False)
    out["perf_recent"] = _loads([s.get("perf_recent") or {} for s in snapshots], True)
    out["perf_dtype"] = snapshots[0].get("perf_dtype", "unknown")
    out["admission_rate"] = _rate([s["admission_rate"] for s in snapshots
                                   if s.get("admission_rate") is not None])
    for name in ("queued_work", "queued_requests"):  # (key, amount) pairs: add by key
        total: dict[tuple, float] = {}
        for s in snapshots:
            for key, amount in s.get(name) or ():
                total[key] = total.get(key, 0) + amount
        out[name] = sorted(total.items())
    return out
