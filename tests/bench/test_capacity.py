"""The capacity search: on synthetic pass/fail functions (exact probe sequences, the knee
within one resolution step of the threshold, noise, determinism), then ``llmctl bench
--find-capacity`` end to end against a fake server with a known saturation point."""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from llmctl.bench.capacity import (
    MAX_HALVINGS,
    SearchSpace,
    level_seed,
    parse_resolution,
    search,
)
from llmctl.cli.app import build_app
from llmctl.errors import UsageError

from .conftest import fake_server


@dataclass
class Out:
    passed: bool
    aborted: bool = False


def threshold(limit: float):
    """Passes exactly the levels <= limit; records what it was asked."""
    asked = []

    def measure(level, attempt):
        asked.append((level, attempt))
        return Out(level <= limit)
    measure.asked = asked
    return measure


def rate_space(start=12.0, maximum=1024.0, resolution="10%", confirm=1):
    return SearchSpace("rate", start, maximum, parse_resolution(resolution), confirm)


def test_rate_search_probe_sequence():
    # Capacity 37.5 req/s. Doubling brackets it in [24, 48]; bisection: 36 passes, 42
    # and 39 fail; 39 - 36 = 3 <= 10 % of 36, so 36 is rerun once and is the knee.
    measure = threshold(37.5)
    found = search(rate_space(12), measure)
    assert measure.asked == [(12, 0), (24, 0), (48, 0), (36, 0), (42, 0), (39, 0), (36, 1)]
    assert (found.knee, found.confirmed, found.stop, found.bracket) == (36, True, "resolved",
                                                                         (36, 39))
    assert [p.phase for p in found.probes] == ["bracket"] * 3 + ["bisect"] * 3 + ["confirm"]


@pytest.mark.parametrize("by", ["rate", "concurrency"])
def test_knee_within_one_step_of_the_threshold(by):
    """For every threshold and start: the knee passes, the level one step above it fails
    (it is <= the threshold and within one resolution step of it)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        limit = float(rng.uniform(1, 900)) if by == "rate" else float(rng.integers(1, 900))
        start = float(rng.choice([1, 3, 16, 100, 700]))
        for resolution in ("10%", "25%", "2"):
            space = SearchSpace(by, start, 1024.0, parse_resolution(resolution), 1)
            found = search(space, threshold(limit))
            if limit < space.minimum:
                assert found.knee is None and found.stop == "none passed"
                continue
            assert found.stop == "resolved" and found.confirmed
            assert found.knee <= limit < found.knee + space.step(found.knee), (limit, start)
            if by == "concurrency":
                assert all(float(p.level).is_integer() for p in found.probes)


def test_concurrency_levels_are_integers_and_end_at_a_step_of_one():
    measure = threshold(3)
    found = search(SearchSpace("concurrency", 1, 64, parse_resolution("10%"), 1), measure)
    assert measure.asked == [(1, 0), (2, 0), (4, 0), (3, 0), (3, 1)]
    assert found.knee == 3 and found.bracket == (3, 4)


def test_failing_start_halves_down_to_a_floor():
    measure = threshold(5)
    found = search(rate_space(40), measure)
    assert [lv for lv, _ in measure.asked][:3] == [40, 20, 10]
    assert found.knee is not None and found.knee <= 5 < found.knee * 1.1
    nothing = threshold(0)
    found = search(rate_space(8), nothing)
    assert [lv for lv, _ in nothing.asked] == [8 / 2 ** k for k in range(MAX_HALVINGS + 1)]
    assert (found.knee, found.stop, found.bracket) == (None, "none passed", (None, 0.25))


def test_the_maximum_passing_is_reported_as_a_lower_bound():
    found = search(rate_space(100, maximum=300), threshold(1e9))
    assert [p.level for p in found.probes] == [100, 200, 300, 300]
    assert (found.knee, found.stop, found.bracket) == (300, "maximum", (300, None))


def test_a_pass_that_fails_its_repeat_is_a_fail():
    """36 passes once by luck, then fails its rerun: the knee drops to a level that passed
    every run (the search bisects again between the last clean pass and 36)."""
    def measure(level, attempt):
        return Out(level <= 33 or (level == 36 and attempt == 0))

    found = search(rate_space(12), measure)
    levels = [(p.level, p.attempt, p.outcome.passed) for p in found.probes]
    assert levels[:7] == [(12, 0, True), (24, 0, True), (48, 0, False), (36, 0, True),
                          (42, 0, False), (39, 0, False), (36, 1, False)]
    # back to [24, 36]: 30 and 33 pass; 36 - 33 <= 10 % of 33, and 33 is confirmed.
    assert levels[7:] == [(30, 0, True), (33, 0, True), (33, 1, True)]
    assert (found.knee, found.confirmed) == (33, True)


def test_noisy_search_is_deterministic_for_a_seed():
    """A server whose pass/fail is noisy near its capacity (40 +- 4): the same seed gives
    the same probes; the knee always passed all its runs and lies below the noise band's
    top."""
    def noisy(seed):
        def measure(level, attempt):
            jitter = np.random.default_rng(level_seed(seed, level, attempt)).normal(0, 2)
            return Out(level <= 40 + jitter)
        return measure

    runs = [[(p.level, p.attempt) for p in search(rate_space(5), noisy(s)).probes]
            for s in (1, 1, 2, 3, 4, 5)]
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[1:]}) > 1  # the seed matters
    for s in range(30):
        found = search(rate_space(5), noisy(s))
        assert found.confirmed and 30 <= found.knee <= 48
        assert all(p.outcome.passed for p in found.probes if p.level == found.knee)


def test_an_aborted_run_ends_the_search_with_the_best_level_so_far():
    def measure(level, attempt):
        return Out(level <= 30, aborted=level == 48)

    found = search(rate_space(12), measure)
    assert [p.level for p in found.probes] == [12, 24, 48]
    assert (found.knee, found.confirmed, found.stop) == (24, False, "aborted")


def test_level_seeds_are_deterministic_and_distinct():
    assert level_seed(0, 36, 0) == level_seed(0, 36, 0)
    seeds = {level_seed(s, lv, a) for s in (0, 1) for lv in (36, 36.5, 37) for a in (0, 1)}
    assert len(seeds) == 12
    assert level_seed(-1, 2.5, 0) >= 0  # a negative --seed still seeds


def test_resolution_and_space_checks():
    assert parse_resolution("10%").step(50) == pytest.approx(5)
    assert parse_resolution("2.5").step(50) == 2.5 and parse_resolution("2").text == "2"
    for bad in ("0%", "100%", "-1", "x", "0"):
        with pytest.raises(UsageError):
            parse_resolution(bad)
    with pytest.raises(UsageError, match="whole numbers"):
        SearchSpace("concurrency", 1.5, 8)
    with pytest.raises(UsageError, match="must be > 0 and <="):
        SearchSpace("rate", 10, 5)
    with pytest.raises(UsageError, match="load dimension"):
        SearchSpace("tokens", 1, 5)


# --- end to end: llmctl bench --find-capacity against a server of known capacity --------

REPO = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((REPO / "results" / "bench-schema.json").read_text())
runner = CliRunner()
app = build_app()
# 3 slots, each request 20 ms to its first token + 3 x 20 ms: 80 ms a request, so the
# server completes at most 3 / 0.080 = 37.5 requests/s; above that its queue grows.
FAKE = ("--ttft-ms", "20", "--itl-ms", "20", "--max-running", "3")
SLOTS, CAPACITY = 3, 37.5
# Seconds per level. A p95 bound holds when 95 % of a level's requests meet it, so a level
# of fewer than 20 requests fails on a single request the machine stalled (one did: a
# 330 ms TTFT among 50 ms ones, 1 of 5 requests, in a CI run).
LEVEL_S = 2.0


def find_capacity(url, model, tmp_path, *extra, slo="p95_ttft_ms<=60"):
    args = ["bench", "--target", url, "--model", model, "-n", 8, "--input-len", 8,
            "--output-len", 4, "--ignore-eos", "--burstiness", "inf", "--find-capacity",
            "--slo", slo, "--result-dir", tmp_path, "--metrics-interval", 0.2, "--json",
            *extra]
    return runner.invoke(app, [str(a) for a in args])


def test_rate_search_finds_the_servers_capacity_and_stops_overload_early(tiny_llama,
                                                                          tmp_path):
    """Fixed-interval arrivals (D/D/3): below 37.5 req/s no request waits (TTFT 20 ms),
    above it every request waits longer than the one before. The knee must lie within one
    resolution step (10 %) of 37.5, and 64 req/s (1.7x) must stop well before its end.
    The doubling starts at 16: its second level, 32 req/s, is 85 % of capacity (a start
    of 18 put it at 36, 96 %, which failed its SLO once in a full suite). A level lasts
    2 s, so even the first (32 requests) meets p95 with one request stalled by the
    machine: at 1.2 s it sent 19, and 18 of 19 is 94.7 %.

    The bound is 120 ms, 100 ms above the unloaded TTFT: with 60 ms the first level
    (16 req/s, 43 % of capacity) failed once in CI on two requests the machine stalled.
    The margin moves the knee little: above capacity the last request of a 2 s level
    waits ``(rate - 37.5) / 37.5 x 2 s``, over 100 ms from 39.5 req/s (5 % above). Two
    warm-up requests per level keep connection set-up out of the first level's TTFTs."""
    import jsonschema

    with fake_server(*FAKE) as (url, _):
        result = find_capacity(url, tiny_llama, tmp_path, "--duration", LEVEL_S,
                               "--capacity-start", 16, "--gate", "capacity_knee>=30",
                               "--warmup", 2, "--peak-flops", 1e12, "--peak-bandwidth", 1e11,
                               slo="p95_ttft_ms<=120")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["gates"][0]["passed"]  # a CI gate on the capacity itself
    capacity = data["capacity"]
    assert capacity["stop"] == "resolved" and capacity["confirmed"]
    assert abs(capacity["knee"] - CAPACITY) <= 0.1 * CAPACITY, capacity["levels"]
    rows = capacity["levels"]
    assert [(r["level"], r["passed"]) for r in rows[:3]] == [(16, True), (32, True), (64, False)]
    overload = rows[2]
    assert overload["over_saturated"] and overload["saturation"]["ttft_slope_ms_per_s"] > 0
    # A full level sends 64 req/s x 2 s = 128 requests; the detector stops it early.
    assert overload["num_requests"] < 0.6 * 64 * LEVEL_S and overload["duration"] < 0.6 * LEVEL_S
    knee_runs = [r for r in rows if r["level"] == capacity["knee"]]
    assert len(knee_runs) == 2 and all(r["passed"] for r in knee_runs)
    assert knee_runs[-1]["phase"] == "confirm" and knee_runs[0]["seed"] != knee_runs[1]["seed"]
    assert capacity["goodput_at_knee"] == min(r["request_goodput"] for r in knee_runs)
    # the knee's bottleneck: a fake server is nowhere near a 1 TFLOP/s, 100 GB/s roof
    assert [v["bound"] for v in capacity["verdict_at_knee"]] == ["overhead", "overhead"]

    [path] = tmp_path.glob("*-capacity-rate-fake-model-*.json")
    report = json.loads(path.read_text())
    jsonschema.validate(report, SCHEMA)
    assert report["capacity"] == capacity and report["capacity_knee"] == capacity["knee"]
    assert capacity["verdict_at_knee"] == report["verdicts"]
    assert report["request_rate"] == capacity["knee"] and report["repeat"]["n"] == 2
    assert report["slos"] == {"ttft_ms": 120.0} and 95.0 in report["percentiles"]
    markdown = path.with_suffix(".md").read_text()
    assert "## Capacity search by rate, SLO p95_ttft_ms<=120" in markdown and "over-saturated at" in markdown
    curve = path.with_name(path.stem + "-capacity.png")
    assert capacity["curve"] == curve.name and curve.read_bytes()[:4] == b"\x89PNG"


def test_concurrency_search_finds_the_servers_slots(tiny_llama, tmp_path):
    """A closed loop of C clients on 3 slots of 200 ms requests: C <= 3 never waits (TTFT
    50 ms); at C = 4 a third of the requests wait a whole request (TTFT >= 250 ms: sleeps
    only run long). So with the bound at 150 ms the knee is 3, found by 1, 2, 4 (fails),
    3 and 3 again; a closed loop never over-saturates. The 100 ms margin on the passing
    side is for a busy 2-core machine: with 20 ms requests and a 60 or 80 ms bound, one
    request of a passing level delayed by the rest of the suite failed it now and then.
    A level lasts 5 s: 25 requests at C = 1, so one stalled request (24 of 25 = 96 %)
    still meets p95. At 1.2 s (6 requests) one TTFT of 330 ms failed C = 1 in CI."""
    with fake_server("--ttft-ms", "50", "--itl-ms", "50", "--max-running", str(SLOTS)) \
            as (url, _):
        result = find_capacity(url, tiny_llama, tmp_path, "--by", "concurrency",
                               "--duration", 5, "--no-plots", slo="p95_ttft_ms<=150")
    assert result.exit_code == 0, result.output
    capacity = json.loads(result.stdout)["capacity"]
    assert [(r["level"], r["passed"]) for r in capacity["levels"]] == [
        (1, True), (2, True), (4, False), (3, True), (3, True)]
    assert capacity["knee"] == SLOTS and capacity["bracket"] == [3, 4]
    [path] = tmp_path.glob("*-capacity-concurrency-*.md")
    assert "needs to allow one miss" not in path.read_text()  # >= 25 requests a level
    assert not any(r["over_saturated"] for r in capacity["levels"])
    assert [r["max_concurrency"] for r in capacity["levels"]] == [1, 2, 4, 3, 3]


def test_no_level_meeting_the_slo_exits_1_with_the_report(tiny_llama, tmp_path):
    with fake_server(*FAKE) as (url, _):
        result = find_capacity(url, tiny_llama, tmp_path, "--by", "concurrency",
                               "--duration", 0.3, "--no-plots", slo="p95_ttft_ms<=5")
    assert result.exit_code == 1 and "no load level met p95_ttft_ms<=5" in result.output
    [path] = tmp_path.glob("*.json")
    capacity = json.loads(path.read_text())["capacity"]
    # 1 is the lowest concurrency: nothing to halve down to.
    assert capacity["knee"] is None and capacity["stop"] == "none passed"
    assert [r["level"] for r in capacity["levels"]] == [1]
    # 0.3 s of 80 ms requests is < 20 requests: p95 allows no miss, and the report says so.
    [row] = capacity["levels"]
    note = (f"1 of 1 levels sent fewer requests (as few as {row['num_requests']}) than the 20 "
            "p95 needs to allow one miss")
    assert note in path.with_suffix(".md").read_text()


@pytest.mark.parametrize("args, says", [
    (["--find-capacity"], "needs an SLO with percentile bounds"),
    (["--find-capacity", "--slo", "ttft_ms=500"], "needs an SLO with percentile bounds"),
    (["--slo", "p95_ttft_ms<=500"], "pass rule of --find-capacity"),
    (["--find-capacity", "--slo", "p95_ttft_ms<=500", "--sweep", "rate=1,2"], "--sweep"),
    (["--find-capacity", "--slo", "p95_ttft_ms<=500", "--repeat", "2"], "repeats the knee"),
    (["--find-capacity", "--slo", "p95_ttft_ms<=500", "--request-rate", "4"],
     "chooses the request rate"),
    (["--find-capacity", "--slo", "p95_ttft_ms<=500", "--by", "concurrency",
      "--max-concurrency", "4"], "chooses the concurrency"),
    (["--find-capacity", "--slo", "p95_ttft_ms<=500", "--by", "tokens"], "load dimension"),
    (["--find-capacity", "--slo", "p95_ttft_ms<=500", "--capacity-resolution", "0"],
     "--capacity-resolution"),
    (["--find-capacity", "--slo", "p95_ttft_ms<=500", "--capacity-start", "64",
      "--capacity-max", "8"], "--capacity-start"),
    (["--by", "rate"], "--by is an option of --find-capacity"),
    (["--find-capacity", "--slo", "p95_ttft_ms=500"], "cannot read SLO"),
    (["--find-capacity", "--slo", "ttft_ms=500", "--slo", "p95_tpot_ms<=50"], "mixes"),
])
def test_conflicting_or_malformed_options_exit_2(args, says, tmp_path):
    result = runner.invoke(app, ["bench", "--target", "http://127.0.0.1:9", "--result-dir",
                                 str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output
    assert not list(tmp_path.iterdir())
