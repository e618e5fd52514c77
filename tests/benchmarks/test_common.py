"""Run records shared by the benchmark scripts: the contention verdict and the refusal of
an uncommitted tree."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import common
from common import foreign_cores, is_contended, refuse_dirty

from llmctl.utils.cpu_load import CpuSample


def _sample(wall, busy, steal, ours):
    return CpuSample(wall=wall, busy=busy, steal=steal, ours=ours, load=(0.0, 0.0, 0.0))


def test_own_work_is_not_foreign():
    """Two threads busy for 10 s (2000 ticks at 100/s), all of it ours: a quiet round,
    although the load average would read ~2."""
    a, b = _sample(0, 0, 0, 0), _sample(10, 2000, 0, 2000)
    assert foreign_cores(a, b, 100) == 0
    assert not is_contended(foreign_cores(a, b, 100), load_before=2.0, threads=2)


def test_other_work_and_steal_are_foreign():
    a, b = _sample(0, 1000, 0, 500), _sample(10, 2200, 300, 1500)
    # (1200 busy + 300 steal - 1000 ours) ticks / 100 / 10 s = 0.5 cores
    assert foreign_cores(a, b, 100) == pytest.approx(0.5)
    assert is_contended(0.5, load_before=0.0, threads=2)


def test_without_proc_the_load_before_is_compared_with_the_threads():
    assert not is_contended(None, load_before=1.9, threads=2)
    assert is_contended(None, load_before=2.6, threads=2)


def test_a_reaped_child_counts_as_ours():
    """A child that burns 0.5 s of CPU and exits inside the window lands in "ours"
    (through this process's cutime), not in the foreign work."""
    import subprocess

    before = common.sample()
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    after = common.sample()
    assert (after.ours - before.ours) / os.sysconf("SC_CLK_TCK") >= 0.45


def test_measured_round_fills_the_record():
    record = {"name": "r1"}
    with common.measured_round(record, threads=2):
        pass
    assert set(record) >= {"load_before", "load_after", "foreign_cpu_cores", "contended",
                           "round_wall_s"}
    assert len(record["load_before"]) == 3


def test_dirty_tree_is_refused_unless_allowed(capsys):
    state = {"dirty": True, "changed_files": ["llmctl/serve/model/decoder.py"], "commit": "abc"}
    with pytest.raises(SystemExit) as exc:
        refuse_dirty(state, allow_dirty=False)
    assert exc.value.code == 2  # a usage error
    err = capsys.readouterr().err
    assert "llmctl/serve/model/decoder.py" in err and "--allow-dirty" in err
    refuse_dirty(state, allow_dirty=True)
    refuse_dirty({**state, "dirty": False, "changed_files": []}, allow_dirty=False)


def test_finish_run_marks_a_tree_that_changed_during_the_run(monkeypatch):
    report = {"tree": {"commit": "a", "dirty": False}, "dirty": False}
    monkeypatch.setattr(common, "tree_state",
                        lambda: {"commit": "b", "dirty": False, "changed_files": []})
    out = common.finish_run(report, [{"name": "r1", "contended": True}, {"name": "r2"}])
    assert out["dirty"] is True
    assert out["contended_rounds"] == ["r1"] and out["contended"]


def test_dirty_tree_is_refused_only_for_results(tmp_path):
    """A smoke run into /tmp is marked DIRTY, not refused; results/ needs a commit."""
    state = {"dirty": True, "changed_files": ["x.py"], "commit": "abc"}
    refuse_dirty(state, allow_dirty=False, out=tmp_path / "engine-bench.json")
    with pytest.raises(SystemExit):
        refuse_dirty(state, allow_dirty=False, out=common.RESULTS)
    with pytest.raises(SystemExit):
        refuse_dirty(state, allow_dirty=False, out=common.RESULTS / "serve-vs-vllm.json")


def test_changed_files_keep_their_first_character():
    assert common.changed_files(" M benchmarks/a.py\nM  b.py\n") == ["benchmarks/a.py", "b.py"]


def test_table_cells_and_cpu_lists():
    assert common.fmt(None, ".1f") == "?" and common.fmt(1.26, ".1f") == "1.3"
    assert common.cpu_list("0,1") == (0, 1)
    assert common.cpu_list(None) == tuple(common.cpus())


def test_ab_throughput_ratios_within_rounds_and_medians():
    runs = [{"round": 1, "side": "a", "result": {"output_throughput": 120.0}},
            {"round": 1, "side": "b", "result": {"output_throughput": 100.0}},
            {"round": 2, "side": "b", "result": {"output_throughput": 80.0}},
            {"round": 2, "side": "a", "result": {"output_throughput": 100.0}},
            {"round": 3, "side": "a", "result": {"output_throughput": 90.0}},
            {"round": 3, "side": "b", "error": "server died"}]  # no ratio for round 3
    per_round, summary = common.ab_throughput(runs, 3, ("a", "b"), "a_over_b")
    assert per_round == [{"round": 1, "a_over_b": 1.2}, {"round": 2, "a_over_b": 1.25}]
    assert summary["a"]["output_throughput"] == 100.0  # median of 120, 100, 90
    assert summary["b"]["output_throughput"] == 90.0
    assert summary["a_over_b"] == pytest.approx(1.225)
    # a third side in the same rounds (kv_cache_dtype's int8 and fp8 against bf16)
    third = [{"round": 1, "side": "c", "result": {"output_throughput": 50.0}}]
    assert common.ab_throughput(runs + third, 3, ("a", "b"), "a_over_b") == (per_round, summary)
    per_c, _ = common.ab_throughput(runs + third, 3, ("c", "b"), "c_over_b")
    assert per_c == [{"round": 1, "c_over_b": 0.5}]
    # both against b, merged per round (kv_cache_dtype, lora_batch)
    merged, both = common.against_base(runs + third, 3, ("a", "c"), "b", "{}_over_b")
    assert merged == [{"round": 1, "a_over_b": 1.2, "c_over_b": 0.5},
                      {"round": 2, "a_over_b": 1.25}]
    assert both["a_over_b"] == pytest.approx(1.225) and both["c_over_b"] == 0.5
    assert both["c"]["output_throughput"] == 50.0


def test_rotation_puts_every_side_in_every_position():
    orders = [common.rotation(("x", "y", "z"), rnd) for rnd in (1, 2, 3, 4)]
    assert orders == [["x", "y", "z"], ["y", "z", "x"], ["z", "x", "y"], ["x", "y", "z"]]


def test_ab_markdown_has_every_round_and_the_medians():
    per_round = [{"round": 1, "a_over_b": 1.2, "c_over_b": 0.5}, {"round": 2, "a_over_b": 1.25}]
    summary = {"a": {"output_throughput": 100.0}, "b": {"output_throughput": 90.0},
               "a_over_b": 1.225, "c_over_b": 0.5}
    lines = common.ab_markdown(per_round, summary, [("a", "A side"), ("b", "B side")],
                               [("a_over_b", "a / b"), ("c_over_b", "c / b")])
    assert lines[:4] == ["| round | output tok/s a / b | output tok/s c / b |", "|---|---|---|",
                         "| 1 | 1.200 | 0.500 |", "| 2 | 1.250 | ? |"]  # round 2 lost c
    assert lines[-1] == ("Median over rounds (output tok/s): 100.0 A side, 90.0 B side; "
                         "a/b 1.225; c/b 0.500.")
