"""When each request is sent: seeded arrival processes (pure; no clock, no I/O).

Inter-arrival gaps are gamma distributed with shape ``k = burstiness`` and scale
``1 / (rate * k)``: the mean gap is ``1 / rate`` for every k, and the coefficient of
variation is ``1 / sqrt(k)``. k = 1 is a Poisson process (exponential gaps); k < 1 is
burstier, k > 1 smoother, k = inf a fixed interval. Same parametrisation as vLLM's
``--burstiness``. ``rate = inf`` sends everything at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from llmctl.errors import UsageError


def parse_rate(text: str | float) -> float:
    """``"inf"`` or a positive number of requests per second."""
    try:
        rate = float(text)
    except (TypeError, ValueError):
        rate = math.nan
    if not rate > 0:
        raise UsageError(f"request rate must be a positive number or 'inf', got {text!r}",
                         "e.g. --request-rate 4 or --request-rate inf")
    return rate


def _check(rate: float, burstiness: float) -> None:
    if not rate > 0:
        raise UsageError(f"request rate must be > 0, got {rate}", "use a positive rate or inf")
    if not burstiness > 0:
        raise UsageError(f"burstiness must be > 0, got {burstiness}",
                         "1 = Poisson, < 1 burstier, > 1 smoother, inf = fixed interval")


def gaps(rate: float, burstiness: float, rng: np.random.Generator) -> Iterator[float]:
    """An endless stream of inter-arrival gaps in seconds."""
    _check(rate, burstiness)
    while True:
        if math.isinf(rate):
            yield 0.0
        elif math.isinf(burstiness):
            yield 1.0 / rate
        else:
            for gap in rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=256):
                yield float(gap)


def offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator,
            normalize: bool = True) -> list[float]:
    """Send times of ``n`` requests, seconds after the start.

    With ``normalize`` the schedule is rescaled so the last request goes out at exactly
    ``n / rate`` (as vLLM does): throughput then does not depend on how the seed's gaps
    happened to sum, while the shape of the process is unchanged.
    """
    _check(rate, burstiness)
    if n <= 0:
        return []
    stream = gaps(rate, burstiness, rng)
    times = np.cumsum([next(stream) for _ in range(n)])
    if normalize and not math.isinf(rate) and times[-1] > 0:
        times *= (n / rate) / times[-1]
    return [float(t) for t in times]
