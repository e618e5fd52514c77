"""A request's phases from the times the engine recorded (pure arithmetic, for traces).

One engine request moves through three phases, each ending where the next begins::

    arrival ──queue──> first scheduled ──prefill──> first token ──decode──> finish

The prefill is split into its chunks (one per engine step that computed prompt tokens
before the first token): chunk i runs from its step's start to chunk i + 1's start, the
last to the first token, so the chunks tile the prefill exactly and their gaps (other
requests' steps, a preemption's wait) are charged to the chunk they interrupt. Each
preemption is an event on the phase it fell in. A request that ended early (aborted,
failed, timed out) has only the phases it reached, the last one ending at ``end``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmctl.serve.engine.outputs import RequestMetrics


@dataclass(frozen=True)
class Phase:
    name: str  # "queue" | "prefill" | "prefill_chunk" | "decode"
    start: float  # wall seconds (time.time())
    end: float
    parent: str | None = None  # None: the request's span; else the phase it divides
    tokens: int | None = None  # prompt tokens computed (prefill, prefill_chunk)
    index: int | None = None  # the chunk's position (prefill_chunk)
    events: tuple[tuple[str, float], ...] = field(default=())  # (name, wall time)


def request_phases(m: RequestMetrics, end: float) -> list[Phase]:
    """The phases of one engine request, in time order; ``end`` closes whichever phase is
    still open (the request's finish time when it has one)."""
    finish = m.finish_time if m.finish_time is not None else end
    scheduled, first_token = m.first_scheduled_time, m.first_token_time
    bounds = [("queue", m.arrival_time, scheduled if scheduled is not None else finish)]
    if scheduled is not None:
        bounds.append(("prefill", scheduled, first_token if first_token is not None
                       else finish))
        if first_token is not None:
            bounds.append(("decode", first_token, finish))
    phases = []
    for name, start, stop in bounds:
        stop = max(stop, start)  # times from two threads: never a negative span
        events = tuple(("preempted", t) for t in m.preemption_times if start <= t < stop
                       or (name == bounds[-1][0] and t >= stop))
        tokens = sum(n for _, n in m.prefill_chunks) if name == "prefill" else None
        phases.append(Phase(name, start, stop, tokens=tokens, events=events))
        if name == "prefill":
            phases.extend(_chunks(m.prefill_chunks, start, stop))
    return phases


def _chunks(chunks: tuple[tuple[float, int], ...], start: float, stop: float) -> list[Phase]:
    out = []
    for i, (t, tokens) in enumerate(chunks):
        begin = min(max(t, start), stop)
        until = chunks[i + 1][0] if i + 1 < len(chunks) else stop
        out.append(Phase("prefill_chunk", begin, min(max(until, begin), stop),
                         parent="prefill", tokens=tokens, index=i))
    return out
