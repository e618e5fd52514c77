"""A bench report's utilization (MFU/MBU per phase), verdicts and cost: from the client's
records against any server, from the engine's own counters against llmctl serve."""

from __future__ import annotations

import json

import pytest

from llmctl.perf.costs import ModelCost

from .test_cli import bench, only_report, small, validate


def _cost(tiny_llama) -> ModelCost:
    return ModelCost.from_config(json.loads((tiny_llama / "config.json").read_text()))


def test_client_side_utilization_verdicts_and_cost(server, tiny_llama, tmp_path):
    result = small(server, tiny_llama, tmp_path, "--peak-flops", 1e12, "--peak-bandwidth", 2e11,
                   "--cost-per-hour", 3.6, "--no-plots", "--gate", "decode_mbu>=0")
    assert result.exit_code == 0, result.output
    report = only_report(tmp_path)
    validate(report)
    util = report["utilization"]
    assert util["available"] and util["source"].startswith("client records")
    assert "override" in util["peak_source"]
    cost = _cost(tiny_llama)
    prompts = report["input_lens"]
    pre, dec = util["phases"]["prefill"], util["phases"]["decode"]
    # prefill FLOPs: every prompt through the cost model (the fake server has no cache)
    assert pre["flops"] == pytest.approx(sum(cost.prefill_flops(p) for p in prompts))
    # decode: each generated token after the first at its context
    contexts = [p + j for p, o in zip(prompts, report["output_lens"]) for j in range(1, o)]
    assert dec["flops"] == pytest.approx(sum(cost.flops_per_token(c) for c in contexts))
    for phase, u in util["phases"].items():
        assert u["mfu"] == pytest.approx(u["flops"] / u["busy_seconds"] / 1e12)
        assert u["mbu"] == pytest.approx(u["bytes"] / u["busy_seconds"] / 2e11)
        assert report[f"{phase}_mfu"] == u["mfu"] and report[f"{phase}_mbu"] == u["mbu"]
    # a tiny model on a fake server is nowhere near either roof
    assert {v["bound"] for v in report["verdicts"]} == {"overhead"}
    assert {s["rule"] for v in report["verdicts"] for s in v["next"]} == {
        "prefill-overhead", "decode-overhead"}
    c = report["cost"]
    assert c["run_usd"] == pytest.approx(3.6 * report["duration"] / 3600)
    assert c["usd_per_request"] == pytest.approx(c["run_usd"] / 8)
    share = pre["busy_seconds"] / (pre["busy_seconds"] + dec["busy_seconds"])
    assert c["usd_per_1m_output_tokens"] == pytest.approx(
        c["run_usd"] * (1 - share) / report["total_output_tokens"] * 1e6)
    assert report["cost_usd_per_1m_output_tokens"] == c["usd_per_1m_output_tokens"]
    md = next(tmp_path.glob("*.md")).read_text()
    assert "decode: MFU" in md and "is overhead-bound" in md and "per 1M output tokens" in md


def test_unknown_hardware_is_a_usage_error_before_any_work(tmp_path):
    result = bench("--target", "http://127.0.0.1:9", "--hardware", "h100-90gb",
                   "--result-dir", tmp_path)
    assert result.exit_code == 2
    assert "h100-80gb" in result.output and not list(tmp_path.iterdir())


def test_llmctl_serve_gives_utilization_from_its_own_counters(tiny_llama, tmp_path):
    """Launched llmctl serve: the engine meters each step, the report takes the counters'
    changes over the run (exact token accounting, step wall time)."""
    result = bench("--model", tiny_llama, "-n", 4, "--input-len", 8, "--output-len", 4,
                   "--ignore-eos", "--result-dir", tmp_path, "--no-plots",
                   "--server-timeout", 300, "--peak-flops", 1e9, "--peak-bandwidth", 1e9,
                   "--metrics-interval", 0)
    assert result.exit_code == 0, result.output
    report = only_report(tmp_path)
    util = report["utilization"]
    assert util["source"].startswith("engine counters")
    server = report["server_metrics"]
    for phase in ("prefill", "decode"):
        assert util["phases"][phase]["flops"] == server[f"{phase}_flops"] > 0
        assert util["phases"][phase]["busy_seconds"] == server[f"{phase}_busy_seconds"] > 0
    # every token the engine computed, by the cost model: each prompt, then each generated
    # token after the first at its context; a step mixing a prompt chunk with other
    # requests' decode rows counts as prefill, so only the total is exact per phase split
    cost = _cost(tiny_llama)
    prompts, outputs = report["input_lens"], report["output_lens"]
    assert outputs == [4] * 4
    prefill = sum(cost.prefill_flops(p) for p in prompts)
    decode = sum(cost.flops_per_token(p + j) for p in prompts for j in range(1, 4))
    phases = util["phases"]
    assert phases["prefill"]["flops"] + phases["decode"]["flops"] == pytest.approx(
        prefill + decode, rel=1e-9)
    assert phases["prefill"]["flops"] >= prefill * (1 - 1e-9)
