"""The transformers baseline's batch-size sweep stops only when its best size is
bracketed by worse neighbours, or a failed size / the ladder's end is stated."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from batch_sweep import bracket, ladder, next_batch_size


def sweep(rate, *, start: int, limit: int) -> dict[int, float | None]:
    """Run the sweep against a throughput curve ``rate(size)`` (None = out of memory)."""
    results: dict[int, float | None] = {}
    while (size := next_batch_size(results, start=start, limit=limit)) is not None:
        assert size not in results, f"{size} measured twice"
        results[size] = rate(size)
    return results


def test_ladder_is_powers_of_two_then_the_limit():
    assert ladder(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert ladder(100) == [1, 2, 4, 8, 16, 32, 64, 100]


def test_still_rising_at_64_keeps_going_until_it_falls():
    curve = {16: 30.0, 32: 42.0, 64: 51.0, 128: 55.0, 256: 53.0}
    results = sweep(curve.get, start=16, limit=512)
    assert list(results) == [16, 32, 64, 128, 256]
    assert "best 128" in bracket(results, limit=512)
    assert "256: 53.0" in bracket(results, limit=512)


def test_best_at_the_start_extends_downwards():
    curve = {4: 20.0, 8: 25.0, 16: 24.0, 32: 22.0}
    results = sweep(curve.get, start=16, limit=64)
    assert results == {16: 24.0, 32: 22.0, 8: 25.0, 4: 20.0}


def test_out_of_memory_is_the_stated_upper_side():
    results = sweep(lambda s: None if s >= 128 else float(s), start=16, limit=512)
    assert results[128] is None and 256 not in results
    assert "above: 128 failed" in bracket(results, limit=512)


def test_rising_to_the_limit_says_so():
    results = sweep(float, start=16, limit=100)
    assert max(results) == 100
    assert "none (100 is the limit)" in bracket(results, limit=100)


def test_everything_failing_walks_down_to_one():
    results = sweep(lambda s: None, start=8, limit=64)
    assert sorted(results) == [1, 2, 4, 8]
    assert bracket(results, limit=64) == "every batch size tried failed"


def test_start_must_be_on_the_ladder():
    with pytest.raises(ValueError, match="ladder"):
        next_batch_size({}, start=24, limit=64)
