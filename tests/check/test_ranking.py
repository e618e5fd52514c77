from llmctl.check.ranking import Row, rank

T = "bench.chat.output_throughput"


def _row(name, kld, tput, size, passed=True):
    return Row(name, {"mean_kld": kld, T: tput, "size.checkpoint_bytes": size}, passed)


def test_order_front_and_best_passing():
    rows = [_row("w4-rtn", 0.30, 120.0, 80), _row("w4-gptq", 0.12, 118.0, 80),
            _row("w8", 0.01, 90.0, 150), _row("w8-slow", 0.02, 80.0, 150),
            _row("w4-fast-bad", 0.50, 130.0, 80, passed=False)]
    r = rank(rows, T)
    assert r["quality_metric"] == "mean_kld" and r["throughput_metric"] == T
    assert r["order"] == ["w8", "w8-slow", "w4-gptq", "w4-rtn", "w4-fast-bad"]
    # w8-slow is worse than w8 on quality and speed at the same size: dominated
    assert set(r["pareto"]) == {"w4-rtn", "w4-gptq", "w8", "w4-fast-bad"}
    assert r["best"] == "w4-rtn"  # the fastest that passes (the faster one fails a gate)
    assert r["passing"] == ["w4-rtn", "w4-gptq", "w8", "w8-slow"]


def test_without_speed_the_smallest_passing_wins_and_none_passing_has_no_best():
    rows = [Row("a", {"ppl": 10.0, "size.checkpoint_bytes": 100}, True),
            Row("b", {"ppl": 12.0, "size.checkpoint_bytes": 60}, True)]
    assert rank(rows, None)["best"] == "b"
    assert rank(rows, None)["quality_metric"] == "ppl"
    assert rank([Row("a", {"ppl": 1.0}, False)], None)["best"] is None
