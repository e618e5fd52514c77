import xml.etree.ElementTree as ET

import pytest

from llmctl.errors import ConfigError
from llmctl.gates import evaluate_gates, junit_xml, load_gates, parse_gate, wilson_interval


def test_parse_forms():
    g = parse_gate("p99_ttft_ms<=500")
    assert (g.metric, g.op, g.threshold, g.relative) == ("p99_ttft_ms", "<=", 500.0, False)
    g = parse_gate(" task.hellaswag.acc >= 0.95*reference ")
    assert (g.metric, g.op, g.threshold, g.relative) == ("task.hellaswag.acc", ">=", 0.95, True)
    assert parse_gate("x>=reference").threshold == 1.0
    assert parse_gate("wilson(task.a.acc)>0.4").wilson
    assert parse_gate("mean_kld<=5e-2").threshold == pytest.approx(0.05)


@pytest.mark.parametrize("bad", ["", "ppl", "ppl<=", "ppl=>1", "ppl<=abc", "<=1", "a<=1 extra"])
def test_malformed_gates_are_config_errors(bad):
    with pytest.raises(ConfigError, match="cannot parse gate"):
        parse_gate(bad)


def test_evaluate_pass_fail_and_relative():
    gates = load_gates(["ppl_ratio<=1.05", "same_top_p>=0.9", "acc>=0.95*reference"])
    results = evaluate_gates(gates, {"ppl_ratio": 1.07, "same_top_p": 0.93, "acc": 0.60},
                             reference={"acc": 0.62})
    assert [r.passed for r in results] == [False, True, True]
    assert results[2].threshold == pytest.approx(0.589)


def test_missing_metric_and_missing_reference_are_errors():
    with pytest.raises(ConfigError, match="no metric 'nope'.*") as err:
        evaluate_gates([parse_gate("nope<=1")], {"ppl": 1.0})
    assert "ppl" in err.value.remedy
    with pytest.raises(ConfigError, match="reference"):
        evaluate_gates([parse_gate("ppl<=reference")], {"ppl": 1.0})


def test_wilson_interval_matches_hand_computation():
    # 8/10 at 95%: the textbook Wilson interval is (0.4902, 0.9433).
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)


def test_wilson_gate_tolerates_noise_on_small_sets():
    gate = [parse_gate("wilson(acc)>=0.7")]
    assert not evaluate_gates([parse_gate("acc>=0.7")], {"acc": 0.6})[0].passed
    assert evaluate_gates(gate, {"acc": 0.6}, counts={"acc": 10})[0].passed
    assert not evaluate_gates(gate, {"acc": 0.6}, counts={"acc": 1000})[0].passed
    with pytest.raises(ConfigError, match="sample count"):
        evaluate_gates(gate, {"acc": 0.6})


def test_gate_file(tmp_path):
    path = tmp_path / "gates.yaml"
    path.write_text("gates:\n  - ppl_ratio<=1.05\n  - mean_kld<=0.05\n")
    assert [g.metric for g in load_gates(["x<1"], path)] == ["x", "ppl_ratio", "mean_kld"]
    path.write_text("gates: 3\n")
    with pytest.raises(ConfigError, match="list of gate strings"):
        load_gates(file=path)
    with pytest.raises(ConfigError, match="no gate file"):
        load_gates(file=tmp_path / "missing.yaml")


def test_junit_xml_content():
    results = evaluate_gates(load_gates(["a<=1", "b>=2"]), {"a": 0.5, "b": 1.5})
    root = ET.fromstring(junit_xml(results, "quality"))
    assert root.attrib["tests"] == "2" and root.attrib["failures"] == "1"
    cases = root.findall("testcase")
    assert cases[0].find("failure") is None
    assert "b = 1.5" in cases[1].find("failure").attrib["message"]
