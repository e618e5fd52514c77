"""The pure parts of engine processes: replicas' stats merged into the server's, and the
machine's CPUs split between replicas."""

from __future__ import annotations

import pytest

from llmctl.errors import UsageError
from llmctl.perf.utilization import PhaseLoad
from llmctl.serve.core.admission import ServiceRate
from llmctl.serve.engine.stats import EngineStats
from llmctl.serve.proc.engine import Supervision, split_cpus
from llmctl.serve.proc.stats import merge_stats


def _snap(running, waiting, blocks, usage, queried, hits, flops, seconds, rate, work):
    return EngineStats(num_running=running, num_waiting=waiting, kv_cache_blocks=blocks,
                       kv_cache_usage=usage, prefix_cache_queried_tokens=queried,
                       prefix_cache_hit_tokens=hits, prefix_cache_hit_rate=hits / queried,
                       num_steps=10, step_phase_seconds={"forward": seconds},
                       perf_totals={"decode": PhaseLoad(flops, 2 * flops, seconds)},
                       perf_recent={"decode": PhaseLoad(flops, 2 * flops, seconds)},
                       perf_dtype="bf16", admission_rate=rate, queued_work=work)


def test_one_replica_is_passed_through_unchanged():
    snap = _snap(1, 2, 100, 0.5, 10, 5, 1e9, 1.0, None, [])
    assert merge_stats([snap]) == snap
    assert merge_stats([]) == EngineStats()
    assert merge_stats([None, snap, None]) == snap  # replicas that have not reported yet


def test_two_replicas_add_counts_and_recompute_ratios():
    a = _snap(3, 1, 100, 0.5, 100, 90, 4e9, 2.0, ServiceRate(300.0, 0.05, 0.5), [((0,), 10.0)])
    b = _snap(1, 0, 300, 0.1, 300, 0, 2e9, 1.0, ServiceRate(100.0, 0.15, 0.3),
              [((0,), 5.0), ((2,), 7.0)])
    m = merge_stats([a, b])
    assert (m.num_running, m.num_waiting, m.kv_cache_blocks) == (4, 1, 400)
    assert m.kv_cache_usage == pytest.approx((0.5 * 100 + 0.1 * 300) / 400)  # 0.2, not 0.3
    assert m.prefix_cache_hit_rate == pytest.approx(90 / 400)  # not mean(0.9, 0) = 0.45
    assert m.num_steps == 20 and m.step_phase_seconds == {"forward": 3.0}
    # since start: engine-seconds add; the recent window: the longest replica's busy time
    assert m.perf_totals["decode"] == PhaseLoad(6e9, 12e9, 3.0)
    assert m.perf_recent["decode"] == PhaseLoad(6e9, 12e9, 2.0)
    assert m.admission_rate == ServiceRate(400.0, pytest.approx(0.1), pytest.approx(0.4))
    assert m.queued_work == [((0,), 15.0), ((2,), 7.0)]
    assert m.perf_dtype == "bf16" and m.engine_restarts is None


def test_cpus_split_in_contiguous_equal_shares():
    assert split_cpus(1, [0, 1], None) == [(None, None)]  # one replica: torch's defaults
    assert split_cpus(2, [0, 1], None) == [((0,), 1), ((1,), 1)]
    assert split_cpus(2, [4, 5, 6, 7, 8], None) == [((4, 5), 2), ((6, 7), 2)]
    assert split_cpus(2, [0, 1, 2, 3], 2) == [((0, 1), 1), ((2, 3), 1)]  # --threads: the total
    with pytest.raises(UsageError, match="at least 3 CPUs"):
        split_cpus(3, [0, 1], None)


@pytest.mark.parametrize("kwargs,match", [
    ({"replicas": 0}, "--replicas"), ({"step_timeout": 0}, "--engine-step-timeout"),
    ({"max_rss": 0}, "--max-rss"), ({"nice": 20}, "--engine-nice"),
    ({"nice": -1}, "--engine-nice")])
def test_supervision_refuses_nonsense(kwargs, match):
    with pytest.raises(UsageError, match=match):
        Supervision(**kwargs)
