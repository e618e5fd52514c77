"""``llmctl eval`` through the CLI: gates, exit codes, JUnit, reports, compare."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmctl.cli.app import build_app
from llmctl.stats import Z95

runner = CliRunner()
app = build_app()

ITEMS = [
    {"query": "In Python, a function is defined with the keyword", "choices": ["def", "fn", "func"], "gold": 0},
    {"query": "The capital of France is", "choices": ["Berlin", "Paris", "Rome"], "gold": 1},
    {"query": "Fish live in", "choices": ["trees", "clouds", "water"], "gold": 2},
    {"query": "The number of days in a week is", "choices": ["seven", "ten", "two"], "gold": 0},
]


def run(*args):
    return runner.invoke(app, ["eval", *map(str, args)])


@pytest.fixture(scope="module")
def mini_task(tmp_path_factory):
    path = tmp_path_factory.mktemp("tasks") / "mini.jsonl"
    path.write_text("".join(json.dumps(i) + "\n" for i in ITEMS))
    return path


@pytest.fixture
def base_args(tiny_llama, tiny_perturbed, eval_cache):
    return [tiny_perturbed, "--reference", tiny_llama, "--ctx", 64, "--max-windows", 3,
            "--top-k", 32, "--cache-dir", eval_cache]


def test_gates_pass_write_report_markdown_and_junit(base_args, tmp_path):
    report, junit = tmp_path / "r.json", tmp_path / "junit.xml"
    result = run(*base_args, "--gate", "mean_kld<=10", "--gate", "same_top_p>=0.1",
                 "--junit", junit, "-o", report)
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["gates_passed"] is True and len(data["gates"]) == 2
    assert data["metadata"]["data"]["spec"] == "builtin:pydoc-heldout"
    assert data["metadata"]["windows"]["windows"] == 3
    assert len(data["metadata"]["candidate"]["sha256_quick"]) == 64
    assert len(data["metadata"]["reference"]["sha256_quick"]) == 64
    assert "## KL divergence" in report.with_suffix(".md").read_text()
    suite = ET.parse(junit).getroot()
    assert (suite.get("tests"), suite.get("failures")) == ("2", "0")
    assert suite.find("testcase/failure") is None


def test_failing_gate_exits_1_and_lists_it(base_args, tmp_path):
    report, junit = tmp_path / "r.json", tmp_path / "junit.xml"
    result = run(*base_args, "--gate", "mean_kld<=0.0001", "--gate", "ppl_ratio<=100",
                 "--junit", junit, "-o", report)
    assert result.exit_code == 1
    assert "1 of 2 gates failed" in result.output and "mean_kld<=0.0001" in result.output
    assert json.loads(report.read_text())["gates_passed"] is False
    suite = ET.parse(junit).getroot()
    assert (suite.get("tests"), suite.get("failures")) == ("2", "1")
    failure = suite.find("testcase/failure")
    assert "mean_kld = " in failure.get("message") and "<= 0.0001" in failure.get("message")


@pytest.mark.parametrize("gate", ["mean_kld=>0.1", "mean_kld<=", "wilson(acc>=1"])
def test_malformed_gate_exits_2_before_running(gate, tmp_path):
    report = tmp_path / "r.json"
    result = run("no-such-model", "--gate", gate, "-o", report)
    assert result.exit_code == 2
    assert "cannot parse gate" in result.output and "Traceback" not in result.output
    assert not report.exists()


def test_gate_on_a_metric_this_run_cannot_produce_exits_2(tiny_llama):
    result = run(tiny_llama, "--gate", "mean_kld<=0.1")
    assert result.exit_code == 2 and "--reference" in result.output
    result = run(tiny_llama, "--gate", "task.nope.acc>=0.5")
    assert result.exit_code == 2 and "--tasks" in result.output
    result = run(tiny_llama, "--gate", "ppl<=1.1*reference")
    assert result.exit_code == 2 and "--baseline" in result.output


def test_gate_file_and_malformed_gate_file(base_args, tmp_path):
    good = tmp_path / "gates.yaml"
    good.write_text("gates:\n  - ppl_ratio<=100\n  - max_kld<=100\n")
    result = run(*base_args, "--gate-file", good, "--json")
    assert result.exit_code == 0, result.output
    assert [g["gate"] for g in json.loads(result.stdout)["gates"]] == ["ppl_ratio<=100", "max_kld<=100"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("gates: [ppl_ratio<=1.05, 'mean_kld << 3']\n")
    result = run(*base_args, "--gate-file", bad)
    assert result.exit_code == 2 and "cannot parse gate" in result.output


WORDS = ["water", "stone", "light", "paper", "river", "glass", "cloud", "metal", "sound", "green"]


@pytest.fixture(scope="module")
def big_task(tmp_path_factory):
    """200 two-choice items: enough for a paired gate to resolve a 5-point drop."""
    path = tmp_path_factory.mktemp("tasks") / "big.jsonl"
    lines = []
    for i in range(200):
        a, b = WORDS[i % 10], WORDS[(i % 10 + 1 + (i // 10) % 9) % 10]  # never a == b
        lines.append(json.dumps({"id": f"big-{i:03d}", "query": f"Item {i}: the word is",
                                 "choices": [a, b], "gold": i % 2}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def big_baseline(tiny_llama, big_task, tmp_path_factory):
    """The tiny model's own report on the big task: per-item outcomes to pair with."""
    path = tmp_path_factory.mktemp("baseline") / "baseline.json"
    result = run(tiny_llama, "--data", "none", "--tasks", big_task, "-o", path)
    assert result.exit_code == 0, result.output
    return path


def doctored(baseline: Path, tmp_path: Path, flip: int) -> Path:
    """The baseline with ``flip`` of the items the model got wrong marked right: to the
    unchanged model, the reference now looks better by exactly those items."""
    data = json.loads(baseline.read_text())
    items = data["tasks"]["big"]["items"]
    wrong = [item for item in items if not item["acc"]][:flip]
    assert len(wrong) == flip
    for item in wrong:
        item["acc"], item["pred"] = 1, item["gold"]
    data["metrics"]["task.big.acc"] = sum(i["acc"] for i in items) / len(items)
    out = tmp_path / f"baseline-{flip}.json"
    out.write_text(json.dumps(data))
    return out


def test_baseline_keeps_per_item_outcomes(big_baseline):
    data = json.loads(big_baseline.read_text())
    items = data["tasks"]["big"]["items"]
    assert len(items) == 200 and len({i["id"] for i in items}) == 200
    assert all(i["acc"] == int(i["pred"] == i["gold"]) for i in items)
    assert all(i["acc_norm"] == int(i["pred_norm"] == i["gold"]) for i in items)
    assert data["metrics"]["task.big.acc"] == sum(i["acc"] for i in items) / 200


def test_identical_run_passes_a_paired_gate(tiny_llama, big_task, big_baseline, tmp_path):
    junit = tmp_path / "junit.xml"
    result = run(tiny_llama, "--data", "none", "--tasks", big_task, "--baseline", big_baseline,
                 "--gate", "delta(task.big.acc)>=-0.05", "--junit", junit, "--json")
    assert result.exit_code == 0, result.output
    [gate] = json.loads(result.stdout)["gates"]
    assert (gate["gains"], gate["losses"], gate["n"], gate["value"]) == (0, 0, 200, 0.0)
    assert gate["compared"] == pytest.approx(-Z95**2 / (200 + Z95**2))  # -0.0188
    assert gate["detectable_drop"] == pytest.approx(Z95**2 / (200 + Z95**2))
    assert gate["warning"] is None and gate["passed"] is True
    case = ET.parse(junit).getroot().find("testcase")
    assert case.find("failure") is None and "0 lost, 0 gained of 200" in case.find("system-out").text


def test_two_flipped_items_of_200_pass(tiny_llama, big_task, big_baseline, tmp_path):
    # (1 flipped item, and flips both ways, are judged in tests/test_gates.py.)
    result = run(tiny_llama, "--data", "none", "--tasks", big_task,
                 "--baseline", doctored(big_baseline, tmp_path, 2),
                 "--gate", "delta(task.big.acc)>=-0.05", "--json")
    assert result.exit_code == 0, result.output
    [gate] = json.loads(result.stdout)["gates"]
    assert (gate["gains"], gate["losses"]) == (0, 2)
    assert gate["value"] == pytest.approx(-2 / 200) and gate["compared"] > -0.05


def test_a_real_drop_fails_strict_and_paired_gates(tiny_llama, big_task, big_baseline, tmp_path):
    junit, report = tmp_path / "junit.xml", tmp_path / "r.json"
    baseline = doctored(big_baseline, tmp_path, 30)  # the reference 15 points better
    result = run(tiny_llama, "--data", "none", "--tasks", big_task, "--baseline", baseline,
                 "--gate", "delta(task.big.acc)>=-0.05",
                 "--gate", "wilson(task.big.acc)>=0.95*reference",
                 "--gate", "wilson_high(task.big.acc)>=0.5*reference",
                 "--junit", junit, "-o", report)
    assert result.exit_code == 1, result.output
    assert "2 of 3 gates failed" in result.output and "30 lost, 0 gained" in result.output
    gates = json.loads(report.read_text())["gates"]
    assert [g["passed"] for g in gates] == [False, False, True]
    assert gates[0]["value"] == pytest.approx(-0.15) and gates[0]["compared"] < -0.15
    assert gates[1]["bound"] == "low" and gates[1]["compared"] < gates[1]["value"]
    suite = ET.parse(junit).getroot()
    assert (suite.get("tests"), suite.get("failures")) == ("3", "2")
    assert "detectable drop" in suite.find("testcase/failure").get("message")
    md = report.with_suffix(".md").read_text()
    assert "detectable drop" in md and "30 lost, 0 gained" in md


def test_baseline_relative_gate_and_a_set_too_small_to_gate_on(tiny_llama, mini_task,
                                                                 tmp_path):
    baseline = tmp_path / "baseline.json"
    assert run(tiny_llama, "--data", "none", "--tasks", mini_task, "-o", baseline).exit_code == 0
    base_acc = json.loads(baseline.read_text())["metrics"]["task.mini.acc"]
    result = run(tiny_llama, "--data", "none", "--tasks", mini_task, "--baseline", baseline,
                 "--gate", "task.mini.acc>=1.0*reference", "--gate", "task.mini.acc>1.0*reference",
                 "--gate", "delta(task.mini.acc)>=-0.05", "--json")
    assert result.exit_code == 1
    same, above, paired = json.loads(result.stdout)["gates"]
    # The same model: equal to its baseline value, not above it.
    assert same["threshold"] == pytest.approx(base_acc) and same["passed"]
    assert not above["passed"]
    # 4 items cannot rule out a large flip rate: z²/(4 + z²) = 0.49 with none flipped.
    assert paired["compared"] == pytest.approx(-Z95**2 / (4 + Z95**2)) and not paired["passed"]
    assert "too small to gate on" in result.output and "n=4" in result.output


def test_delta_against_a_reference_model(tiny_llama, tiny_perturbed, big_task, tmp_path,
                                         eval_cache):
    report = tmp_path / "r.json"
    result = run(tiny_perturbed, "--reference", tiny_llama, "--data", "none", "--tasks",
                 big_task, "--cache-dir", eval_cache, "--gate", "delta(task.big.acc)>=-1",
                 "-o", report)
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    cand = {i["id"]: i["pred"] == i["gold"] for i in data["tasks"]["big"]["items"]}
    ref = {i["id"]: i["pred"] == i["gold"] for i in data["reference_tasks"]["big"]["items"]}
    [gate] = data["gates"]
    assert gate["gains"] == sum(cand[k] and not ref[k] for k in cand)
    assert gate["losses"] == sum(ref[k] and not cand[k] for k in cand)
    assert gate["value"] == pytest.approx(data["metrics"]["task.big.acc"]
                                          - data["reference_metrics"]["task.big.acc"])


def test_delta_gate_errors_are_usage_errors_before_running(tiny_llama, big_task, big_baseline,
                                                           tmp_path):
    old = json.loads(big_baseline.read_text())
    for task in old["tasks"].values():
        task.pop("items")
    stale = tmp_path / "old-baseline.json"
    stale.write_text(json.dumps(old))
    report = tmp_path / "r.json"
    cases = [
        (["--baseline", stale], "delta(task.big.acc)>=-0.05", "regenerate"),
        ([], "delta(task.big.acc)>=-0.05", "--reference MODEL or --baseline"),
        (["--reference", tiny_llama, "--no-reference-tasks"], "delta(task.big.acc)>=-0.05",
         "--no-reference-tasks"),
        (["--baseline", big_baseline], "delta(task.big.acc)>=-0.05*reference", "difference"),
        (["--baseline", big_baseline], "delta(task.big.n)>=0", "task.NAME.acc"),
        (["--baseline", big_baseline], "wilson_low(task.big.acc_se)>=0", "proportions"),
    ]
    for extra, gate, expect in cases:
        result = run("no-such-model", "--data", "none", "--tasks", big_task, *extra,
                     "--gate", gate, "-o", report)
        assert result.exit_code == 2, (gate, result.output)
        assert expect in result.output and "Traceback" not in result.output, result.output
        assert not report.exists()


def test_compare_side_by_side(base_args, tiny_llama, eval_cache, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert run(tiny_llama, "--reference", tiny_llama, "--ctx", 64, "--max-windows", 3,
               "--top-k", 32, "--cache-dir", eval_cache, "-o", a).exit_code == 0
    assert run(*base_args, "-o", b).exit_code == 0
    result = run("compare", a, b, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    rows = {r["metric"]: r for r in data["rows"]}
    ma, mb = (json.loads(p.read_text())["metrics"] for p in (a, b))
    assert rows["mean_kld"]["values"] == [ma["mean_kld"], mb["mean_kld"]]
    assert rows["ppl"]["deltas"][0] == pytest.approx(mb["ppl"] - ma["ppl"])
    assert rows["ppl"]["ratios"][0] == pytest.approx(mb["ppl"] / ma["ppl"])
    assert data["warnings"] == []
    assert data["ranking"]["metric"] == "mean_kld"
    assert data["ranking"]["order"] == [tiny_llama.name, base_args[0].name]  # self first
    human = run("compare", a, b)
    assert human.exit_code == 0 and "mean_kld" in human.output
    assert run("compare", a).exit_code == 2
    assert run(tiny_llama, "extra-arg").exit_code == 2
