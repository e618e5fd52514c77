"""Which static batch size to try next, until the best one is bracketed.

The baseline's "best batch size" must be a maximum, not the largest size tried: the sweep
walks a ladder of sizes (powers of two up to ``limit``, and ``limit`` itself) outward from
``start`` until the best size has a worse neighbour on both sides, or the side that has
none is stated (a failed size, e.g. out of memory, or the end of the ladder).
"""

from __future__ import annotations


def ladder(limit: int) -> list[int]:
    sizes = [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]
    return sizes + ([limit] if sizes[-1] != limit else [])


def _neighbours(sizes: list[int], best: int) -> tuple[int | None, int | None]:
    i = sizes.index(best)
    return (sizes[i - 1] if i else None), (sizes[i + 1] if i + 1 < len(sizes) else None)


def best_size(results: dict[int, float | None]) -> int | None:
    ok = {size: rate for size, rate in results.items() if rate is not None}
    return max(ok, key=ok.get) if ok else None


def next_batch_size(results: dict[int, float | None], *, start: int, limit: int) -> int | None:
    """The next size to measure, or None when done. ``results`` maps a size to its
    throughput, or to None when that size failed (out of memory)."""
    sizes = ladder(limit)
    start = min(start, limit)
    if start not in sizes:
        raise ValueError(f"start {start} is not on the ladder {sizes}")
    if not results:
        return start
    best = best_size(results)
    if best is None:  # everything tried failed: go smaller
        below = [s for s in sizes if s < min(results)]
        return below[-1] if below else None
    lower, upper = _neighbours(sizes, best)
    for side in (upper, lower):
        if side is not None and side not in results:
            return side
    return None


def bracket(results: dict[int, float | None], *, limit: int) -> str:
    """One line saying why the best size is the best (for the report)."""
    best = best_size(results)
    if best is None:
        return "every batch size tried failed"
    lower, upper = _neighbours(ladder(limit), best)

    def side(size: int | None, where: str) -> str:
        if size is None:
            end = "1 is the smallest size" if where == "below" else f"{limit} is the limit"
            return f"none ({end})"
        rate = results.get(size)
        if rate is None:
            return f"{size} failed" if size in results else f"{size} not tried"
        return f"{size}: {rate:.1f}"

    return (f"best {best}: {results[best]:.1f}; below: {side(lower, 'below')}; "
            f"above: {side(upper, 'above')}")
