"""``EngineStats``: one snapshot of an engine, what ``LLMEngine.stats()`` returns.

Read by field: ``/metrics`` (:mod:`llmctl.serve.api.metrics`), the server's queue limit
and deadline admission (:mod:`llmctl.serve.engine.async_engine`), and the engine
processes, which send each replica's snapshot over a pipe (a dataclass pickles) and sum
them with :meth:`EngineStats.merge`.

Each field declares how the replicas' values merge (its ``merge`` metadata), so the
server's snapshot is defined once, from the fields: counts add up (requests, tokens,
blocks, steps, seconds); ratios are recomputed from the summed counts they are ratios
of, never averaged (an idle replica's 0 % hit rate must not halve a busy one's).
Utilization: FLOPs and bytes add up; busy seconds do not in the recent window, because
replicas run at the same time on their own cores and the peak is the whole machine's,
so the window's busy time is the longest replica's (work/max-busy, a lower bound on the
machine's rate while any replica worked). Deadline admission sees one queue served at
the replicas' summed rate.

``EngineCounters`` are the running totals the engine adds to at every step (a mutable
object of its own: the snapshot is frozen).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from llmctl.perf.utilization import PhaseLoad
from llmctl.serve.core.admission import ServiceRate, expected_tokens
from llmctl.serve.core.block_manager import DROPPED

# how one field of several snapshots becomes the server's: f(snapshots, field name)
Merge = Callable[[list["EngineStats"], str], Any]


def _add(snaps: list[EngineStats], name: str) -> Any:
    return sum(getattr(s, name) for s in snaps)


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def _ratio_of(numerator: str, denominator: str) -> Merge:
    """The ratio of two summed counts."""
    def merge(snaps: list[EngineStats], name: str) -> float:
        return _ratio(_add(snaps, numerator), _add(snaps, denominator))
    return merge


def _weighted_by(weight: str) -> Merge:
    """A fraction of a summed count (the KV usage of all replicas' blocks)."""
    def merge(snaps: list[EngineStats], name: str) -> float:
        return _ratio(sum(getattr(s, name) * getattr(s, weight) for s in snaps),
                      _add(snaps, weight))
    return merge


def _first(snaps: list[EngineStats], name: str) -> Any:
    return getattr(snaps[0], name)


def _add_by_key(snaps: list[EngineStats], name: str) -> dict:
    out: dict = {}
    for s in snaps:
        for key, amount in getattr(s, name).items():
            out[key] = out.get(key, 0.0) + amount
    return out


def _add_pairs(snaps: list[EngineStats], name: str) -> list:
    """(key, amount) pairs, added by key."""
    total: dict = {}
    for s in snaps:
        for key, amount in getattr(s, name):
            total[key] = total.get(key, 0) + amount
    return sorted(total.items())


def _loads(busy_is_max: bool) -> Merge:
    def merge(snaps: list[EngineStats], name: str) -> dict[str, PhaseLoad]:
        out: dict[str, PhaseLoad] = {}
        for s in snaps:
            for phase, load in getattr(s, name).items():
                have = out.get(phase)
                if have is None:
                    out[phase] = load
                    continue
                seconds = (max(have.seconds, load.seconds) if busy_is_max
                           else have.seconds + load.seconds)
                out[phase] = PhaseLoad(have.flops + load.flops, have.bytes + load.bytes,
                                       seconds)
        return out
    return merge


def _rate(snaps: list[EngineStats], name: str) -> ServiceRate | None:
    rates = [s.admission_rate for s in snaps if s.admission_rate is not None]
    if not rates:
        return None
    n = len(rates)
    return ServiceRate(tokens_per_second=sum(r.tokens_per_second for r in rates),
                       seconds_per_step=sum(r.seconds_per_step for r in rates) / n,
                       output_fraction=sum(r.output_fraction for r in rates) / n)


def _count(merge: Merge = _add) -> Any:
    return field(default=0, metadata={"merge": merge})


def _number(merge: Merge) -> Any:
    return field(default=0.0, metadata={"merge": merge})


@dataclass
class EngineCounters:
    """Totals since start, added to by the engine's step (read into every snapshot)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_prompt_tokens: int = 0
    num_requests_finished: int = 0
    num_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0


@dataclass(frozen=True)
class EngineStats:
    """An engine's state and totals at one moment (defaults: an engine with nothing in it)."""

    num_running: int = _count()
    # the scheduler's queue and the requests added but not yet taken in
    num_waiting: int = _count()
    kv_cache_usage: float = _number(_weighted_by("kv_cache_blocks"))
    kv_cache_blocks: int = _count()
    kv_cache_tokens: int = _count()
    kv_slots_allocated: int = _count()  # slots in blocks held by running sequences
    kv_slots_used: int = _count()  # ... of which hold a token
    prefix_cache_hit_rate: float = _number(
        _ratio_of("prefix_cache_hit_tokens", "prefix_cache_queried_tokens"))
    prefix_cache_queried_tokens: int = _count()
    prefix_cache_hit_tokens: int = _count()
    num_preemptions: int = _count()
    spec_acceptance_rate: float = _number(_ratio_of("spec_accepted_tokens",
                                                    "spec_draft_tokens"))
    spec_mean_accepted_per_step: float = _number(_ratio_of("spec_accepted_tokens",
                                                           "spec_verify_steps"))
    # EngineCounters
    prompt_tokens: int = _count()
    generation_tokens: int = _count()
    cached_prompt_tokens: int = _count()
    num_requests_finished: int = _count()
    num_steps: int = _count()
    spec_draft_tokens: int = _count()
    spec_accepted_tokens: int = _count()
    spec_verify_steps: int = _count()
    # wall seconds in each phase of step() (llm_engine.STEP_PHASES), summed
    step_phase_seconds: dict[str, float] = field(default_factory=dict,
                                                 metadata={"merge": _add_by_key})
    # FLOPs, bytes and seconds by phase (llmctl.perf.meter): since start (counters of
    # work done: engine-seconds add), and over the meter's window (the longest busy time)
    perf_totals: dict[str, PhaseLoad] = field(default_factory=dict,
                                              metadata={"merge": _loads(False)})
    perf_recent: dict[str, PhaseLoad] = field(default_factory=dict,
                                              metadata={"merge": _loads(True)})
    # the dtype the matrix products run in -> the peak MFU is measured against
    perf_dtype: str = field(default="unknown", metadata={"merge": _first})
    # deadline admission (llmctl.serve.core.admission): None until measured
    admission_rate: ServiceRate | None = field(default=None, metadata={"merge": _rate})
    # (admission key, expected tokens) and (queue key, requests) pairs: the deadline
    # check's and the queue limit's inputs (AsyncEngine)
    queued_work: list[tuple[tuple, float]] = field(default_factory=list,
                                                   metadata={"merge": _add_pairs})
    queued_requests: list[tuple[tuple, int]] = field(default_factory=list,
                                                     metadata={"merge": _add_pairs})
    # engine processes (llmctl.serve.proc) only: None when the engine runs in-process
    engine_restarts: int | None = field(default=None, metadata={"merge": _first})
    engine_replicas_up: int | None = field(default=None, metadata={"merge": _first})

    @classmethod
    def merge(cls, snapshots: list[EngineStats]) -> EngineStats:
        """The server's snapshot from its replicas' (one replica's is returned as is;
        none is an empty engine's)."""
        if len(snapshots) <= 1:
            return snapshots[0] if snapshots else cls()
        return cls(**{f.name: f.metadata["merge"](snapshots, f.name) for f in fields(cls)})


def queued_work(seqs: list, policy, fraction: float
                ) -> tuple[list[tuple[tuple, float]], list[tuple[tuple, int]]]:
    """Tokens the waiting sequences will still compute, by the policy's admission key
    (:func:`llmctl.serve.core.admission.expected_tokens`), and how many they are, by its
    queue key: ``EngineStats.queued_work`` and ``queued_requests``."""
    work: dict[tuple, float] = {}
    count: dict[tuple, int] = {}
    for seq in seqs:
        req = seq.request
        key = policy.admission_key(req.priority, req.priority_class)
        output = (req.params.max_tokens - seq.num_output_tokens) * (1 + seq.pending_fork)
        work[key] = work.get(key, 0.0) + expected_tokens(seq.num_uncomputed_tokens, output,
                                                         fraction)
        queue = policy.queue_key(req.priority_class)
        count[queue] = count.get(queue, 0) + 1
    return sorted(work.items()), sorted(count.items())


def kv_slots(running: list, block_size: int) -> tuple[int, int]:
    """Slots in blocks held by running sequences, and how many of them hold a token."""
    filled: dict[int, int] = {}
    for seq in running:
        for i, block_id in enumerate(seq.block_table):
            if block_id == DROPPED:
                continue
            n = min(block_size, max(0, seq.num_computed_tokens - i * block_size))
            if n > filled.get(block_id, -1):
                filled[block_id] = n
    return len(filled) * block_size, sum(filled.values())
