"""The capacity search: the highest load level whose run meets the SLO.

Pure: running a level is injected (``measure(level, attempt) -> outcome``), so the search
is tested on synthetic pass/fail functions, and ``llmctl bench --find-capacity`` plugs in
a real run (:mod:`llmctl.bench.suite`). A level is a request rate (req/s) or, with
``--by concurrency``, a whole number of requests in flight.

1. Bracket: run ``start``; while it passes, double up to ``maximum``. If ``start`` fails,
   halve down to ``minimum`` until a level passes. The knee now lies between the last
   pass ``lo`` and the first fail ``hi``.
2. Bisect: run the midpoint of [lo, hi] and keep the half it points to, until
   hi - lo <= the resolution step at lo (a fraction of lo, or an absolute step; for
   concurrency at least 1, so integer levels always end).
3. Confirm: run ``lo`` again ``confirm`` times. A noisy pass that fails a repeat is a
   fail: ``lo`` becomes the new ``hi``, the highest level below it that passed every run
   becomes ``lo`` (or step 1 halves down again), and the search returns to step 2.

The knee is a level that passed every one of its runs. Fails are never repeated, so
noise can only lower the knee, never raise it: a capacity claim must survive a rerun,
a miss need not. The search assumes that load hurts (a level above a fail fails), and
so never probes above a fail or below a pass except in step 3's demotion.

Determinism: the search itself has no randomness. Each run's workload seed is
``level_seed(seed, level, attempt)``, so a given seed reproduces every level's arrival
times, and a repeat of a level draws fresh ones (it samples the arrival process's noise
as well as the server's).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from llmctl.errors import UsageError

BY = ("rate", "concurrency")
# Defaults when --capacity-start/--capacity-max are not given (req/s or requests).
DEFAULT_START = {"rate": 1.0, "concurrency": 1.0}
DEFAULT_MAXIMUM = {"rate": 1024.0, "concurrency": 1024.0}
# A failing start rate is halved at most this many times (1/32 of it) before giving up.
MAX_HALVINGS = 5
# A run cap: doubling from 1 to 1024 is 11 runs, bisection to 10% about 4, confirmation
# 1 or 2; a search that needs more is fighting noise and says so instead of running on.
MAX_RUNS = 30


class Outcome(Protocol):
    passed: bool
    aborted: bool  # Ctrl-C or a dead target: stop the search, keep what was measured


@dataclass(frozen=True)
class Resolution:
    """When bisection stops: hi - lo <= ``step(lo)``. ``10%`` is relative, ``2`` absolute."""

    value: float
    relative: bool

    def step(self, lo: float) -> float:
        return self.value * lo if self.relative else self.value

    @property
    def text(self) -> str:
        return f"{self.value * 100:g}%" if self.relative else f"{self.value:g}"


def parse_resolution(text: str | float) -> Resolution:
    raw = str(text).strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?|\.\d+)\s*(%?)", raw)
    value = float(match[1]) if match else math.nan
    relative = bool(match and match[2])
    if relative:
        value /= 100.0
    if not value > 0 or (relative and value >= 1):
        raise UsageError(f"cannot read --capacity-resolution {raw!r}",
                         "write a percentage of the level in (0%, 100%), e.g. 10%, or an "
                         "absolute step in the level's unit, e.g. 2")
    return Resolution(value, relative)


@dataclass(frozen=True)
class SearchSpace:
    by: str = "rate"
    start: float = 1.0
    maximum: float = 1024.0
    resolution: Resolution = Resolution(0.1, True)
    confirm: int = 1  # extra runs of the knee candidate
    max_runs: int = MAX_RUNS

    def __post_init__(self) -> None:
        if self.by not in BY:
            raise UsageError(f"--by {self.by!r} is not a load dimension",
                             f"use one of: {', '.join(BY)}")
        if self.integer and not (float(self.start).is_integer()
                                 and float(self.maximum).is_integer()):
            raise UsageError("concurrency levels are whole numbers",
                             "give --capacity-start and --capacity-max as integers")
        if not 0 < self.start <= self.maximum:
            raise UsageError(f"--capacity-start {self.start:g} must be > 0 and <= "
                             f"--capacity-max {self.maximum:g}", "swap or fix them")
        if self.confirm < 0:
            raise UsageError("--capacity-confirm must be >= 0", "1 repeats the knee once")

    @property
    def integer(self) -> bool:
        return self.by == "concurrency"

    @property
    def minimum(self) -> float:
        return 1.0 if self.integer else self.start / 2 ** MAX_HALVINGS

    def step(self, lo: float) -> float:
        step = self.resolution.step(lo)
        return max(1.0, step) if self.integer else step

    def up(self, level: float) -> float:
        return min(level * 2, self.maximum)

    def down(self, level: float) -> float:
        return max(float(math.floor(level / 2)) if self.integer else _round(level / 2),
                   self.minimum)

    def midpoint(self, lo: float, hi: float) -> float:
        if self.integer:
            return float((int(lo) + int(hi)) // 2)
        mid = _round((lo + hi) / 2)
        return mid if lo < mid < hi else (lo + hi) / 2


def _round(value: float) -> float:
    """4 significant digits: level labels stay readable (28.13, not 28.125000001)."""
    return float(f"{value:.4g}")


def level_seed(seed: int, level: float, attempt: int) -> int:
    """The arrival seed of one run: a hash of (seed, level in milli-units, attempt)."""
    state = np.random.SeedSequence([seed % 2**63, round(level * 1000), attempt])
    return int(state.generate_state(1)[0])


@dataclass(frozen=True)
class Probe:
    level: float
    attempt: int  # 0: the level's first run; 1, 2, ...: its repeats
    phase: str  # "bracket" | "bisect" | "confirm"
    outcome: Outcome


@dataclass
class SearchResult:
    knee: float | None  # highest level that passed all its runs (None: none passed)
    confirmed: bool  # the knee passed its confirmation runs
    stop: str  # why the search ended (STOPS)
    bracket: tuple[float | None, float | None]  # final (last pass, first fail)
    probes: list[Probe] = field(default_factory=list)


STOPS = {
    "resolved": "the knee is within the resolution of the first failing level",
    "maximum": "the maximum level passed: the capacity is at least that",
    "none passed": "no level met the SLO, down to the lowest tried",
    "aborted": "a run was interrupted or the target went down",
    "run limit": f"more than {MAX_RUNS} runs: noisy outcomes keep moving the knee",
}


class _Stop(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Search:
    def __init__(self, space: SearchSpace, measure: Callable[[float, int], Outcome]) -> None:
        self.space = space
        self.measure = measure
        self.probes: list[Probe] = []

    def run(self, level: float, phase: str) -> bool:
        if len(self.probes) >= self.space.max_runs:
            raise _Stop("run limit")
        attempt = sum(p.level == level for p in self.probes)
        outcome = self.measure(level, attempt)
        self.probes.append(Probe(level, attempt, phase, outcome))
        if outcome.aborted:
            raise _Stop("aborted")
        return bool(outcome.passed)

    def clean_passes(self) -> list[float]:
        """Levels that passed every run so far."""
        levels = {p.level for p in self.probes}
        return sorted(lv for lv in levels
                      if all(p.outcome.passed for p in self.probes if p.level == lv))

    def descend(self, hi: float) -> tuple[float | None, float]:
        """Halve down from a failing ``hi`` until a level passes: (that pass or None at
        the floor, the lowest fail)."""
        while hi > self.space.minimum:
            level = self.space.down(hi)
            if level >= hi:
                break
            if self.run(level, "bracket"):
                return level, hi
            hi = level
        return None, hi

    def confirm(self, lo: float) -> bool:
        while sum(p.level == lo for p in self.probes) < 1 + self.space.confirm:
            if not self.run(lo, "confirm"):
                return False
        return True


def search(space: SearchSpace, measure: Callable[[float, int], Outcome]) -> SearchResult:
    """Find the knee; ``measure(level, attempt)`` runs one level (see the module doc)."""
    s = _Search(space, measure)
    lo: float | None = None
    hi: float | None = None
    try:
        if s.run(space.start, "bracket"):
            lo = space.start
            while lo < space.maximum:
                level = space.up(lo)
                if s.run(level, "bracket"):
                    lo = level
                else:
                    hi = level
                    break
        else:
            lo, hi = s.descend(space.start)
        while lo is not None:
            while hi is not None and hi - lo > space.step(lo):
                mid = space.midpoint(lo, hi)
                if s.run(mid, "bisect"):
                    lo = mid
                else:
                    hi = mid
            if s.confirm(lo):
                return SearchResult(lo, True, "maximum" if hi is None else "resolved",
                                    (lo, hi), s.probes)
            hi = lo  # a pass that failed its repeat is a fail
            below = [lv for lv in s.clean_passes() if lv < hi]
            if below:
                lo = below[-1]
            else:
                lo, hi = s.descend(hi)
        return SearchResult(None, False, "none passed", (None, hi), s.probes)
    except _Stop as stop:
        best = [lv for lv in s.clean_passes() if hi is None or lv < hi]
        return SearchResult(best[-1] if best else None, False, stop.reason,
                            (best[-1] if best else None, hi), s.probes)
