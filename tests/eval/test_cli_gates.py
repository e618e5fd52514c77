"""``llmctl eval`` through the CLI: gates, exit codes, JUnit, reports, compare."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from typer.testing import CliRunner

from llmctl.cli.app import build_app

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
    assert "mean_kld" in failure.get("message") and "<= 0.0001" in failure.get("message")


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


def test_baseline_relative_and_wilson_gates(tiny_llama, tiny_perturbed, mini_task, tmp_path):
    baseline = tmp_path / "baseline.json"
    result = run(tiny_llama, "--data", "none", "--tasks", mini_task, "-o", baseline)
    assert result.exit_code == 0, result.output
    base_acc = json.loads(baseline.read_text())["metrics"]["task.mini.acc"]
    result = run(tiny_perturbed, "--data", "none", "--tasks", mini_task, "--baseline", baseline,
                 "--gate", "wilson(task.mini.acc)>=0.5*reference", "--json")
    assert result.exit_code == 0, result.output
    gate = json.loads(result.stdout)["gates"][0]
    assert gate["threshold"] == pytest.approx(0.5 * base_acc)
    assert gate["compared"] >= gate["value"]  # the Wilson upper bound on 4 items
    result = run(tiny_perturbed, "--data", "none", "--tasks", mini_task, "--baseline", baseline,
                 "--gate", "task.mini.acc>=1.01")
    assert result.exit_code == 1


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
