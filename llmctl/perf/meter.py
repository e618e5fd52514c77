"""The engine's per-step FLOPs, bytes and seconds, by phase: running totals (Prometheus
counters) and a sliding window (the MFU/MBU gauges).

One step computes ``new`` tokens of each scheduled sequence on top of ``context`` tokens
already in its KV cache. With :class:`llmctl.perf.costs.ModelCost`'s formulas:

- FLOPs = sum over sequences of ``prefill_flops(context + new, cached=context)`` (the new
  tokens' products, attention over context + position, and the head for the last) --
  a one-token decode row is the same formula with ``new = 1``;
- bytes = the weights read once per step + each sequence's (context + new) x KV bytes
  per token (every step re-reads each sequence's keys and values).

A step with any prompt token is a prefill step, one with generated tokens only a decode
step: a mixed step's time cannot be split, so it goes wholly to prefill (as in vLLM's
step-level accounting).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable

from llmctl.perf.utilization import PHASES, PhaseLoad

WINDOW_SECONDS = 30.0


def step_load(cost, weights_read: float, items: Iterable[tuple[int, int]],
              seconds: float) -> PhaseLoad:
    """FLOPs and bytes of one step of ``items`` = (context, new tokens) per sequence."""
    flops = kv = 0.0
    for context, new in items:
        flops += cost.prefill_flops(context + new, cached=context)
        kv += cost.sequence_kv_bytes(context + new)  # a window's share in windowed layers
    return PhaseLoad(flops, weights_read + kv, seconds)


class StepMeter:
    """Totals since start and the last :data:`WINDOW_SECONDS` of steps, per phase. The
    window's sums are kept as steps enter and leave it, so reading them (every stats
    snapshot, ten times a second while busy) costs O(phases), not O(steps)."""

    def __init__(self, window: float = WINDOW_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self._clock = clock
        self.totals = {p: PhaseLoad(0.0, 0.0, 0.0) for p in PHASES}
        self._recent: collections.deque[tuple[float, str, PhaseLoad]] = collections.deque()
        self._sums = {p: [0.0, 0.0, 0.0, 0] for p in PHASES}  # flops, bytes, seconds, steps

    def record(self, phase: str, load: PhaseLoad) -> None:
        self.totals[phase] = self.totals[phase] + load
        now = self._clock()
        self._recent.append((now, phase, load))
        self._shift(phase, load, 1)
        self._trim(now)

    def _shift(self, phase: str, load: PhaseLoad, sign: int) -> None:
        sums = self._sums[phase]
        sums[3] += sign
        if sums[3] == 0:  # no step of this phase left: no float residue of subtractions
            sums[:] = [0.0, 0.0, 0.0, 0]  # (a residue over ~0 s would read as a huge MFU)
            return
        sums[0] += sign * load.flops
        sums[1] += sign * load.bytes
        sums[2] += sign * load.seconds

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.window:
            _, phase, load = self._recent.popleft()
            self._shift(phase, load, -1)

    def recent(self) -> dict[str, PhaseLoad]:
        """The window's loads per phase (busy seconds only: idle time is not counted, so
        a gauge reads the utilization while the engine ran, not averaged with idling)."""
        self._trim(self._clock())
        return {p: PhaseLoad(*sums[:3]) for p, sums in self._sums.items()}
