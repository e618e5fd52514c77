"""Confidence bounds on accuracies: one proportion (Wilson) and a paired difference (Tango).

Every bound here is a limit of a two-sided 95% interval (``z = 1.96``), i.e. a one-sided
97.5% confidence bound: a gate that passes only when the bound clears its threshold lets
a candidate whose true value sits exactly on the threshold through at most 2.5% of the
time.

Paired difference. A candidate and its reference answer the same ``n`` items. Only the
discordant items carry information about the difference::

                         reference right   reference wrong
    candidate right            a                gains (b)
    candidate wrong        losses (c)              d

    Δ = acc(candidate) - acc(reference) = (b - c) / n

Tango's score interval (Tango 1998, Stat Med 17:891) inverts the score test of
``H0: π_b - π_c = Δ0``: with ``q`` the maximum-likelihood loss-cell probability under
H0 (the root of ``2n q² + (-b - c + (2n - b + c) Δ0) q - c Δ0 (1 - Δ0) = 0``),

    T(Δ0) = (b - c - n Δ0) / sqrt(n (2 q + Δ0 (1 - Δ0)))

and the interval is ``{Δ0 : |T(Δ0)| <= z}``. At ``Δ0 = 0`` T is McNemar's statistic
``(b - c) / sqrt(b + c)``. Unlike a Wald or bootstrap interval it stays honest when few
or no items flip: with ``b = c = 0`` the bounds are ``±z² / (n + z²)`` (0.071 at n = 50,
0.019 at n = 200), because zero flips among 50 items cannot rule out a 7% flip rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Z95 = 1.959963984540054  # Φ⁻¹(0.975)
_BISECTIONS = 64  # halves [-1, 1] below 1e-18: past float precision


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson 1927)."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(max(0.0, p * (1 - p) / n + z * z / (4 * n * n))) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class PairedCounts:
    """Outcomes of a candidate and its reference on the same ``n`` items."""

    n: int
    gains: int  # candidate right, reference wrong
    losses: int  # candidate wrong, reference right

    @property
    def discordant(self) -> int:
        return self.gains + self.losses

    @property
    def difference(self) -> float:
        return (self.gains - self.losses) / self.n if self.n else 0.0


def tango_statistic(gains: float, losses: float, n: int, delta: float) -> float:
    """Tango's score statistic T(Δ0) for the paired difference (see the module docstring)."""
    b, c = gains, losses
    a2 = 2 * n
    lin = -b - c + (2 * n - b + c) * delta
    const = -c * delta * (1 - delta)
    q = (math.sqrt(max(0.0, lin * lin - 4 * a2 * const)) - lin) / (2 * a2)
    numerator = b - c - n * delta
    variance = n * (2 * q + delta * (1 - delta))
    if variance <= 0:  # Δ0 = ±1: only the data Δ̂ = Δ0 are possible there
        return 0.0 if numerator == 0 else math.copysign(math.inf, numerator)
    return numerator / math.sqrt(variance)


def _lower(gains: float, losses: float, n: int, z: float) -> float:
    """The smallest Δ0 in [-1, Δ̂] with T(Δ0) <= z (T falls from +inf at -1 to 0 at Δ̂)."""
    lo, hi = -1.0, (gains - losses) / n
    if tango_statistic(gains, losses, n, lo) <= z:
        return lo
    for _ in range(_BISECTIONS):
        mid = (lo + hi) / 2
        if tango_statistic(gains, losses, n, mid) > z:
            lo = mid
        else:
            hi = mid
    return hi


def paired_difference_interval(gains: float, losses: float, n: int,
                               z: float = Z95) -> tuple[float, float]:
    """Tango's score interval for acc(candidate) - acc(reference) on the same n items."""
    if n <= 0:
        return -1.0, 1.0
    if gains < 0 or losses < 0 or gains + losses > n:
        raise ValueError(f"impossible paired counts: gains={gains}, losses={losses}, n={n}")
    # Swapping gains and losses mirrors the difference: the upper bound is a lower bound.
    return _lower(gains, losses, n, z), -_lower(losses, gains, n, z)


def wilson_margin(p: float, n: int, side: str, z: float = Z95) -> float:
    """How far the Wilson bound on ``side`` ("low" | "high") lies from a measured p."""
    low, high = wilson_interval(p * n, n, z)
    return p - low if side == "low" else high - p


def paired_margin(discordant: int, n: int, z: float = Z95) -> float:
    """How far the paired bound lies from Δ̂ = 0 when ``discordant`` items flip both ways
    equally: the smallest difference the paired test can tell from no change."""
    half = discordant / 2
    return -paired_difference_interval(half, half, n, z)[0]
