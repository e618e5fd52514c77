"""Gates: parsing, strict and paired judgement on data where the right verdict is known,
detectable drops, JUnit, and gate errors through ``llmctl bench compare``."""

import json
import xml.etree.ElementTree as ET

import pytest
from typer.testing import CliRunner

from llmctl.errors import ConfigError
from llmctl.eval.paired import pair
from llmctl.gates import GateError, evaluate_gates, junit_xml, load_gates, parse_gate
from llmctl.stats import Z95


def test_parse_forms():
    g = parse_gate("p99_ttft_ms<=500")
    assert (g.metric, g.op, g.threshold, g.relative, g.form) == ("p99_ttft_ms", "<=", 500.0,
                                                                 False, "value")
    g = parse_gate(" task.hellaswag.acc >= 0.95*reference ")
    assert (g.metric, g.op, g.threshold, g.relative) == ("task.hellaswag.acc", ">=", 0.95, True)
    assert parse_gate("x>=reference").threshold == 1.0
    assert parse_gate("mean_kld<=5e-2").threshold == pytest.approx(0.05)
    g = parse_gate("delta( task.a.acc )>=-0.05")
    assert (g.form, g.metric, g.threshold, g.side()) == ("delta", "task.a.acc", -0.05, "low")
    # Plain wilson is the strict side: the lower bound for >=, the upper for <=.
    assert [parse_gate(t).side() for t in ("wilson(a)>0.4", "wilson(a)<=0.4",
                                           "wilson_low(a)<=0.4", "wilson_high(a)>=0.4",
                                           "a>=0.4")] == ["low", "high", "low", "high", None]


@pytest.mark.parametrize("bad", ["", "ppl", "ppl<=", "ppl=>1", "ppl<=abc", "<=1", "a<=1 extra",
                                 "wilson(acc>=1", "foo(acc)>=1", "wilson_lo(acc)>=1"])
def test_malformed_gates_are_usage_errors(bad):
    with pytest.raises(GateError, match="cannot parse gate") as err:
        parse_gate(bad)
    assert err.value.exit_code == 2 and "delta(task.x.acc)>=-0.05" in err.value.remedy
    assert isinstance(err.value, ConfigError)  # library callers catching ConfigError still do


@pytest.mark.parametrize("bad,why", [("wilson(a)==0.5", "=="),
                                     ("delta(task.a.acc)>=0.95*reference", "difference"),
                                     ("delta(task.a.acc)>=reference", "difference")])
def test_forms_that_make_no_sense_are_rejected(bad, why):
    with pytest.raises(GateError, match=why):
        parse_gate(bad)


def test_evaluate_pass_fail_and_relative():
    gates = load_gates(["ppl_ratio<=1.05", "same_top_p>=0.9", "acc>=0.95*reference"])
    results = evaluate_gates(gates, {"ppl_ratio": 1.07, "same_top_p": 0.93, "acc": 0.60},
                             reference={"acc": 0.62})
    assert [r.passed for r in results] == [False, True, True]
    assert results[2].threshold == pytest.approx(0.589)
    assert all(r.detectable is None for r in results)  # no counts: not known as proportions


def test_unknown_non_numeric_and_unmeasured_metrics():
    with pytest.raises(GateError, match="no numeric metric 'nope'") as err:
        evaluate_gates([parse_gate("nope<=1")], {"ppl": 1.0, "date": "2026-01-01"})
    assert err.value.exit_code == 2 and "ppl" in err.value.remedy and "date" not in err.value.remedy
    with pytest.raises(GateError, match="no numeric metric 'date'"):
        evaluate_gates([parse_gate("date<=1")], {"ppl": 1.0, "date": "2026-01-01"})
    with pytest.raises(GateError, match="reference"):
        evaluate_gates([parse_gate("ppl<=reference")], {"ppl": 1.0})
    # Measured nothing (e.g. no request completed): the run failed, not the command line.
    with pytest.raises(ConfigError, match="not measured") as err:
        evaluate_gates([parse_gate("p99_ttft_ms<=500")], {"p99_ttft_ms": None})
    assert err.value.exit_code == 1


def test_bound_forms_need_counts_and_paired_data():
    with pytest.raises(GateError, match="sample count"):
        evaluate_gates([parse_gate("wilson_low(acc)>=0.5")], {"acc": 0.6})
    with pytest.raises(GateError, match="per-item results"):
        evaluate_gates([parse_gate("delta(task.a.acc)>=-0.05")], {"task.a.acc": 0.6})


# -- verdicts on per-item data where the right answer is known ------------------------------


def outcomes(n: int, right: set[int]) -> dict[str, int]:
    return {f"item-{i}": int(i in right) for i in range(n)}


def judge(texts, cand: dict[str, int], ref: dict[str, int]):
    """Gates on task.t.acc the way llmctl eval judges them: counts, the reference's
    accuracy, and the per-item pairing."""
    n = len(cand)
    metrics = {"task.t.acc": sum(cand.values()) / n}
    return evaluate_gates(load_gates(texts), metrics, {"task.t.acc": sum(ref.values()) / n},
                          {"task.t.acc": n}, {"task.t.acc": pair(cand, ref, "t")})


def test_issue_regression_078_to_056_on_50_items_fails_strict_and_paired_gates():
    ref = outcomes(50, set(range(39)))  # 0.78
    cand = outcomes(50, set(range(11, 39)))  # loses 11 of them: 0.56
    lenient, strict, low, paired = judge(
        ["wilson_high(task.t.acc)>=0.85*reference", "wilson(task.t.acc)>=0.85*reference",
         "wilson_low(task.t.acc)>=0.85*reference", "delta(task.t.acc)>=-0.05"], cand, ref)
    # The old default (the upper bound) lets a 22-point drop through: this is the bug.
    assert lenient.passed and lenient.compared > lenient.threshold
    assert not strict.passed and not low.passed and strict.compared == low.compared
    assert low.compared < low.value < low.threshold
    assert not paired.passed
    assert (paired.losses, paired.gains, paired.n) == (11, 0, 50)
    assert paired.value == pytest.approx(-0.22) and paired.compared < -0.22


def test_identical_runs_pass_where_the_set_is_large_enough():
    ref = outcomes(200, set(range(0, 200, 3)) | set(range(100)))
    [result] = judge(["delta(task.t.acc)>=-0.05"], dict(ref), ref)
    assert result.passed and (result.gains, result.losses) == (0, 0)
    assert result.compared == pytest.approx(-Z95**2 / (200 + Z95**2))  # closed form, -0.019
    assert result.warning is None


@pytest.mark.parametrize("lost,gained", [(1, 0), (2, 0), (1, 1), (2, 1)])
def test_one_or_two_flipped_items_of_200_pass_a_5_point_delta_gate(lost, gained):
    right = set(range(150))
    ref = outcomes(200, right)
    cand = outcomes(200, (right - set(range(lost))) | set(range(150, 150 + gained)))
    [result] = judge(["delta(task.t.acc)>=-0.05"], cand, ref)
    assert (result.losses, result.gains) == (lost, gained)
    assert result.passed, result.describe()


def test_a_real_drop_on_200_items_fails_a_5_point_delta_gate():
    right = set(range(150))
    ref = outcomes(200, right)
    cand = outcomes(200, (right - set(range(20))) | {190, 191})  # -0.09
    [result] = judge(["delta(task.t.acc)>=-0.05"], cand, ref)
    assert not result.passed and result.value == pytest.approx(-0.09)


def test_too_small_a_set_is_flagged_and_fails_strict_gates_even_unchanged():
    ref = outcomes(50, set(range(39)))
    tight, wide = judge(["delta(task.t.acc)>=-0.05", "delta(task.t.acc)>=-0.10"], dict(ref), ref)
    # No item flipped, yet 50 items cannot rule out a 7.1% flip rate: z²/(50 + z²).
    assert tight.detectable == pytest.approx(Z95**2 / (50 + Z95**2))
    assert tight.tolerance == pytest.approx(0.05) and not tight.passed
    assert "too small to gate on" in tight.warning and "n=50" in tight.warning
    assert wide.passed and wide.warning is None


def test_detectable_drop_of_a_relative_wilson_gate():
    # Reference 0.8 on 10 items: the lower Wilson bound of 8/10 is 0.4902 (textbook), so
    # the gate cannot tell drops under 0.31 from noise; its tolerance is 0.1 * 0.8.
    [result] = evaluate_gates([parse_gate("wilson_low(acc)>=0.9*reference")], {"acc": 0.8},
                              {"acc": 0.8}, {"acc": 10})
    assert result.detectable == pytest.approx(0.8 - 0.4902, abs=1e-4)
    assert result.tolerance == pytest.approx(0.08)
    assert "too small" in result.warning and not result.passed
    # A gate that asks for an improvement is not "too small", it is strict by design.
    [result] = evaluate_gates([parse_gate("wilson_low(acc)>=1.1*reference")], {"acc": 0.8},
                              {"acc": 0.8}, {"acc": 10})
    assert result.tolerance < 0 and result.warning is None


def test_result_dict_carries_the_statistics():
    ref = outcomes(50, set(range(39)))
    cand = outcomes(50, set(range(2, 39)))
    [result] = judge(["delta(task.t.acc)>=-0.25"], cand, ref)
    data = result.to_dict()
    assert data["form"] == "delta" and data["bound"] == "low" and data["n"] == 50
    assert (data["losses"], data["gains"]) == (2, 0) and data["passed"] is True
    assert data["detectable_drop"] == pytest.approx(result.detectable)
    assert json.loads(json.dumps(data)) == data


# -- files, JUnit ----------------------------------------------------------------------------


def test_gate_file(tmp_path):
    path = tmp_path / "gates.yaml"
    path.write_text("gates:\n  - ppl_ratio<=1.05\n  - delta(task.a.acc)>=-0.05\n")
    assert [g.metric for g in load_gates(["x<1"], path)] == ["x", "ppl_ratio", "task.a.acc"]
    path.write_text("gates: 3\n")
    with pytest.raises(GateError, match="list of gate strings"):
        load_gates(file=path)
    with pytest.raises(GateError, match="no gate file"):
        load_gates(file=tmp_path / "missing.yaml")


def test_committed_gate_file_parses_into_strict_forms():
    from pathlib import Path

    gates = load_gates(file=Path(__file__).parents[1] / "results/reference/gates-w4a16.yaml")
    task_gates = [g for g in gates if g.metric.startswith("task.")]
    assert task_gates and all(g.form == "delta" or g.side() == "low" for g in task_gates)


def test_junit_xml_content():
    results = evaluate_gates(load_gates(["a<=1", "b>=2"]), {"a": 0.5, "b": 1.5})
    ref = outcomes(50, set(range(39)))
    results += judge(["delta(task.t.acc)>=-0.05"], outcomes(50, set(range(11, 39))), ref)
    root = ET.fromstring(junit_xml(results, "quality"))
    assert root.attrib["tests"] == "3" and root.attrib["failures"] == "2"
    cases = root.findall("testcase")
    assert cases[0].find("failure") is None and "a = 0.5" in cases[0].find("system-out").text
    assert "b = 1.5" in cases[1].find("failure").attrib["message"]
    message = cases[2].find("failure").attrib["message"]
    assert "11 lost, 0 gained of 50" in message and "detectable drop" in message
    assert "too small to gate on" in cases[2].find("failure").text


# -- through the CLI: bench compare ------------------------------------------------------------


@pytest.fixture
def bench_reports(tmp_path):
    paths = []
    for i, throughput in enumerate((100.0, 90.0)):
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps({"completed": 10, "failed": 0, "date": "20260101-000000",
                                    "output_throughput": throughput, "p99_ttft_ms": 50.0}))
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("gate,expect", [
    ("date<=1", "no numeric metric 'date'"),
    ("nope>=1", "no numeric metric 'nope'"),
    ("delta(output_throughput)>=-1", "per-item results"),
    ("wilson_low(output_throughput)>=1", "sample count"),
    ("output_throughput=>1", "cannot parse gate"),
])
def test_bench_compare_gate_errors_are_usage_errors(bench_reports, gate, expect):
    from llmctl.cli.app import build_app

    result = CliRunner().invoke(build_app(), ["bench", "compare", *bench_reports, "--gate", gate])
    assert result.exit_code == 2, result.output
    assert expect in result.output and "unexpected error" not in result.output
    if "numeric metric" in expect:
        assert "output_throughput" in result.output  # the metrics it could have named


def test_bench_compare_gate_verdicts(bench_reports):
    from llmctl.cli.app import build_app

    app = build_app()
    ok = CliRunner().invoke(app, ["bench", "compare", *bench_reports, "--gate",
                                  "output_throughput>=0.85*reference", "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["gates"][0]["threshold"] == pytest.approx(85.0)
    bad = CliRunner().invoke(app, ["bench", "compare", *bench_reports, "--gate",
                                   "output_throughput>=0.95*reference"])
    assert bad.exit_code == 1 and "FAIL" in bad.output


def test_baseline_keyword_compares_with_the_baseline_and_falls_back_to_the_reference():
    gate = parse_gate("output_throughput>=0.9*baseline")
    assert gate.relative and gate.relative_to == "baseline" and gate.threshold == 0.9
    assert parse_gate("ppl<=1.05*reference").relative_to == "reference"
    metrics = {"output_throughput": 95.0}
    # with a baseline given, *baseline uses it (and *reference keeps the reference)
    [r] = evaluate_gates([gate], metrics, reference={"output_throughput": 200.0},
                         baseline={"output_throughput": 100.0})
    assert r.threshold == pytest.approx(90.0) and r.passed
    # eval/bench have one comparison run: there the two words name the same values
    [r] = evaluate_gates([gate], metrics, reference={"output_throughput": 200.0})
    assert r.threshold == pytest.approx(180.0) and not r.passed
