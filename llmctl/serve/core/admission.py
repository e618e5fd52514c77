"""Deadline-aware admission: refuse at once a request that cannot finish in time.

For a new request, from what the engine measured over its recent steps::

    wait = W / R            W: tokens of the work queued ahead of it
    run  = P / R + f M s    P: its prompt, M: its max_tokens (times n)

- ``W`` sums, over the waiting requests that go before it (same or more urgent class or
  priority), their uncomputed tokens plus ``f`` times their remaining ``max_tokens``.
- ``R`` is the tokens per second the engine computed in its recent *saturated* steps,
  those after which requests were still waiting: the rate at which a queue drains. Steps
  of a half-idle engine would understate it (a batch of one computes far fewer tokens per
  second than a full batch), and a low ``R`` would refuse requests that would have made it.
- Under a policy that ages requests (fair), ``wait`` is at most ``B + W_own / R``: after
  its aging bound ``B`` a request of a lower class goes before the higher classes' work
  still queued, but not before the work of its own class queued ahead of it (``W_own``).
  So a batch request behind a flood of another class is admitted (it starts at ``B``),
  while a flood's own requests still count each other.
- ``s`` is the mean seconds of those steps: a sequence gets one output token per step.
- ``f`` is the fraction of ``max_tokens`` recently finished requests actually generated
  (1 until some finish): ``max_tokens`` is a ceiling, and most requests stop earlier.

A request is refused when ``wait + run`` exceeds the time left before its deadline *and*
something is queued ahead of it: the refusal is about overload. A request that would
miss its deadline on an idle engine is the client's choice of length, and is left to its
timeout. Without an estimate (cold start, or no saturated step in the window) nothing is
refused.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

WINDOW_SECONDS = 30.0
MIN_STEPS = 8  # saturated steps in the window before R is trusted
FINISHED_KEPT = 256  # finished requests the output fraction is taken over


@dataclass(frozen=True)
class ServiceRate:
    tokens_per_second: float  # R
    seconds_per_step: float  # s
    output_fraction: float  # f


@dataclass(frozen=True)
class Refusal:
    """Why a request cannot meet its deadline (all in seconds, ``ahead`` in tokens)."""

    wait: float
    run: float
    left: float
    ahead: float
    rate: float

    @property
    def retry_after(self) -> int:
        """Seconds until the queue ahead has drained enough for the same request to fit."""
        return max(1, math.ceil(self.wait + self.run - max(self.left, 0.0)))

    def reason(self) -> str:
        queue = self.ahead / self.rate
        waits = (f"about {self.wait:.1f} s at the measured {self.rate:.0f} tokens/s"
                 if self.wait >= queue else  # capped by the policy's aging
                 f"{queue:.1f} s at the measured {self.rate:.0f} tokens/s, but with aging "
                 f"it starts in about {self.wait:.1f} s")
        return (f"cannot finish before its deadline: {self.ahead:.0f} tokens are queued ahead "
                f"of it ({waits}) and "
                f"it needs about {self.run:.1f} s itself, but {max(self.left, 0.0):.1f} s are "
                f"left; retry in {self.retry_after} s, or ask for fewer tokens")


def expected_tokens(uncomputed: int, remaining_output: int, fraction: float) -> float:
    """Tokens a request will still compute: what is not in the cache yet, and its
    remaining output scaled by the fraction of ``max_tokens`` requests really use."""
    return uncomputed + fraction * remaining_output


def check_deadline(*, ahead: float, prompt_tokens: int, max_tokens: int, left: float,
                   rate: ServiceRate | None, wait_bound: float | None = None,
                   ahead_own: float = 0.0) -> Refusal | None:
    """A :class:`Refusal` if the request cannot finish in ``left`` seconds, else None.
    ``wait_bound``: after this many seconds only ``ahead_own`` (the work of its own class
    queued ahead, part of ``ahead``) still goes before it (the fair policy's aging)."""
    if rate is None or ahead <= 0:
        return None
    r = rate.tokens_per_second
    wait = ahead / r
    if wait_bound is not None:
        wait = min(wait, wait_bound + min(ahead_own, ahead) / r)
    run = prompt_tokens / r + rate.output_fraction * max_tokens * rate.seconds_per_step
    if wait + run <= left:
        return None
    return Refusal(wait=wait, run=run, left=left, ahead=ahead, rate=r)


class RateMeter:
    """The engine's recent saturated steps and finished requests -> :class:`ServiceRate`.

    Fed from the engine thread (one step at a time); read there too (its stats)."""

    def __init__(self, window: float = WINDOW_SECONDS, min_steps: int = MIN_STEPS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self.min_steps = min_steps
        self._clock = clock
        self._steps: collections.deque[tuple[float, int, float]] = collections.deque()
        self._tokens = 0
        self._seconds = 0.0
        self._finished: collections.deque[tuple[int, int]] = collections.deque(
            maxlen=FINISHED_KEPT)

    def record_step(self, tokens: int, seconds: float, saturated: bool) -> None:
        now = self._clock()
        if saturated and tokens > 0:
            self._steps.append((now, tokens, seconds))
            self._tokens += tokens
            self._seconds += seconds
        self._trim(now)

    def record_finish(self, output_tokens: int, max_tokens: int) -> None:
        if max_tokens > 0:
            self._finished.append((output_tokens, max_tokens))

    def _trim(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - self.window:
            _, tokens, seconds = self._steps.popleft()
            self._tokens -= tokens
            self._seconds -= seconds

    def estimate(self) -> ServiceRate | None:
        self._trim(self._clock())
        if len(self._steps) < self.min_steps or self._seconds <= 0:
            return None
        used = sum(out for out, _ in self._finished)
        asked = sum(cap for _, cap in self._finished)
        fraction = min(1.0, used / asked) if asked else 1.0
        return ServiceRate(tokens_per_second=self._tokens / self._seconds,
                           seconds_per_step=self._seconds / len(self._steps),
                           output_fraction=fraction)
