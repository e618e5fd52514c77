"""Rank the candidates of a recipe search: quality, throughput, size and the Pareto front.

Quality is the first of ``QUALITY_KEYS`` every candidate has (lower is better: the KL
divergence from the reference, then the perplexity ratio, then perplexity); throughput
is the first bench workload's median ``output_throughput`` (higher is better); size is
the bytes on disk of what is served: the engine when the pipeline builds one, else the
checkpoint. A candidate is on the Pareto front when no other is at
least as good on every measured axis and better on one.

The best passing candidate: among those that pass every gate, the fastest (the gates
already hold the quality bar); without a speed measurement the smallest, and without
either the best in quality.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

QUALITY_KEYS = ("mean_kld", "ppl_ratio", "ppl")


@dataclass(frozen=True)
class Row:
    name: str
    metrics: dict
    passed: bool


def _axis(rows: Sequence[Row], keys: Sequence[str]) -> str | None:
    for key in keys:
        if rows and all(isinstance(r.metrics.get(key), (int, float)) for r in rows):
            return key
    return None


def _dominates(a: tuple, b: tuple) -> bool:
    return all(x <= y for x, y in zip(a, b, strict=True)) and a != b


def rank(rows: Sequence[Row], throughput_key: str | None) -> dict:
    quality = _axis(rows, QUALITY_KEYS)
    speed = _axis(rows, [throughput_key] if throughput_key else [])
    size = _axis(rows, ["size.engine_bytes", "size.checkpoint_bytes"])  # what is served
    # every axis as "lower is better"
    axes = [(quality, 1.0), (speed, -1.0), (size, 1.0)]
    used = [(k, sign) for k, sign in axes if k is not None]

    def point(row: Row) -> tuple:
        return tuple(sign * float(row.metrics[k]) for k, sign in used)

    front = [r.name for r in rows
             if used and not any(_dominates(point(o), point(r)) for o in rows if o is not r)]
    order = sorted(rows, key=lambda r: float(r.metrics[quality])) if quality else list(rows)
    passing = [r for r in rows if r.passed]
    best = None
    if passing:
        key, sign = ((speed, -1.0) if speed else (size, 1.0) if size else (quality, 1.0)
                     if quality else (None, 1.0))
        best = min(passing, key=lambda r: sign * float(r.metrics[key])).name if key \
            else passing[0].name
    return {"quality_metric": quality, "throughput_metric": speed, "size_metric": size,
            "order": [r.name for r in order], "pareto": front, "passing": [r.name for r in passing],
            "best": best}
