"""``llmctl bench`` end to end against the fake server: reports, schema, gates, compare,
sweeps, repeats, a launched server, a dying target and Ctrl-C."""

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmctl.cli.app import build_app

from .conftest import FAKE_SERVER, fake_server

REPO = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((REPO / "results" / "bench-schema.json").read_text())
runner = CliRunner()
app = build_app()


def bench(*args):
    return runner.invoke(app, ["bench", *map(str, args)])


def validate(report: dict) -> None:
    try:
        import jsonschema
    except ImportError:  # minimal check without the optional validator
        missing = [k for k in SCHEMA["required"] if k not in report]
        assert not missing, missing
        return
    jsonschema.validate(report, SCHEMA)


def small(url, tiny, tmp_path, *extra):
    return bench("--target", url, "--model", tiny, "-n", 8, "--input-len", 16,
                 "--output-len", 4, "--result-dir", tmp_path, "--metrics-interval", 0.2,
                 *extra)


def only_report(directory: Path) -> dict:
    [path] = [p for p in directory.glob("*.json") if "sweep" not in p.name]
    return json.loads(path.read_text())


def test_report_written_schema_valid_and_consistent(server, tiny_llama, tmp_path):
    result = small(server, tiny_llama, tmp_path, "--max-concurrency", 4, "--request-rate", 50,
                   "--slo", "ttft_ms=5000", "--label", "smoke", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    [path] = map(Path, data["reports"])
    assert re.fullmatch(r"smoke-50qps-c4-fake-model-\d{8}-\d{6}\.json", path.name)
    report = json.loads(path.read_text())
    validate(report)
    assert report["completed"] + report["failed"] == report["num_requests"] == 8
    assert report["completed"] == 8 and report["model_id"] == "fake-model"
    assert report["total_output_tokens"] == sum(report["output_lens"]) == 32
    assert report["request_goodput"] == pytest.approx(report["request_throughput"])
    assert report["metadata"]["model"]["checkpoint_hash"]
    assert report["metadata"]["dataset"]["fingerprint"] == report["dataset"]["fingerprint"]
    assert report["server_metrics"]["available"] and report["server_generation_tokens"] == 32
    assert path.with_suffix(".md").read_text().startswith("# llmctl bench: smoke")
    png = path.with_name(path.stem + "-cdf.png")
    try:
        import matplotlib  # noqa: F401 - the optional [plots] extra
    except ImportError:  # without it: no plot, and a warning that says what to install
        assert not png.exists() and (
            "plots need matplotlib (pip install 'llmctl[plots]' (or matplotlib)); plots skipped"
            in result.output)
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_same_seed_same_prompts_and_arrivals(server, tiny_llama, tmp_path):
    starts = []
    for run_dir in ("a", "b"):
        result = small(server, tiny_llama, tmp_path / run_dir, "--request-rate", 40, "--seed",
                       3, "--no-plots")
        assert result.exit_code == 0, result.output
        starts.append(only_report(tmp_path / run_dir))
    a, b = starts
    assert a["dataset"]["fingerprint"] == b["dataset"]["fingerprint"]
    assert a["input_lens"] == b["input_lens"]
    # Same seeded arrival schedule (the actual send times add the client's jitter).
    assert a["scheduled_times"] == b["scheduled_times"]
    assert len(set(a["scheduled_times"])) == 8 and a["scheduled_times"][-1] == pytest.approx(0.2)


def test_failed_requests_are_counted(tiny_llama, tmp_path):
    with fake_server("--ttft-ms", "2", "--itl-ms", "1", "--fail-every", "3") as (url, _):
        result = small(url, tiny_llama, tmp_path, "--no-plots", "--backend", "openai-chat")
    assert result.exit_code == 0, result.output
    report = only_report(tmp_path)
    validate(report)
    # Request 1 is the initial test request; measured are 2..9, of which 3, 6, 9 fail.
    assert (report["completed"], report["failed"]) == (5, 3)
    assert sum("injected failure" in e for e in report["errors"]) == 3


def test_failing_initial_request_stops_before_measuring(tiny_llama, tmp_path):
    with fake_server("--fail-every", "1") as (url, _):
        result = small(url, tiny_llama, tmp_path, "--no-plots")
    assert result.exit_code == 1 and "initial test request failed" in result.output
    assert "HTTP 500" in result.output and not list(tmp_path.glob("*.json"))


def test_shared_prefix_workload_shows_server_prefix_hits(server, tiny_llama, tmp_path):
    result = bench("--target", server, "--model", tiny_llama, "--dataset", "prefix",
                   "--num-prefixes", 2, "--questions-per-prefix", 3, "--prefix-len", 16,
                   "--input-len", 4, "--output-len", 2, "--backend", "openai-chat",
                   "--max-concurrency", 1, "--result-dir", tmp_path, "--no-plots")
    assert result.exit_code == 0, result.output
    report = only_report(tmp_path)
    assert report["completed"] == 6 and report["dataset"]["name"] == "prefix"
    # Each system prompt is seen 3 times: the fake server counts the 2 repeats as hits.
    server_side = report["server_metrics"]
    assert 0 < server_side["prefix_cache_hits"] < server_side["prefix_cache_queries"]
    assert report["server_prefix_cache_hit_rate"] == pytest.approx(
        server_side["prefix_cache_hits"] / server_side["prefix_cache_queries"])


def test_gates_fail_with_exit_1_table_and_junit(server, tiny_llama, tmp_path):
    gate_file = tmp_path / "gates.yaml"
    gate_file.write_text("gates:\n  - completed>=8\n")
    junit = tmp_path / "gates.xml"
    result = small(server, tiny_llama, tmp_path, "--no-plots", "--gate", "p99_ttft_ms<=100000",
                   "--gate", "output_throughput>=1e9", "--gate-file", gate_file, "--junit", junit)
    assert result.exit_code == 1
    assert "output_throughput>=1e9" in result.output and "FAIL" in result.output
    assert "performance gates failed" in result.output
    assert junit.read_text().count("<failure") == 1
    ok = small(server, tiny_llama, tmp_path / "ok", "--no-plots", "--gate", "failed<=0")
    assert ok.exit_code == 0, ok.output


def test_bad_gate_fails_before_running(server, tiny_llama, tmp_path):
    result = small(server, tiny_llama, tmp_path, "--gate", "p99_ttft_ms=<500")
    assert result.exit_code != 0 and "cannot parse gate" in result.output
    assert not list(tmp_path.glob("*.json"))


def test_sweep_and_repeat_then_compare(server, tiny_llama, tmp_path):
    result = small(server, tiny_llama, tmp_path, "--sweep", "concurrency=1,4", "--repeat", 2,
                   "--slo", "ttft_ms=2000", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    paths = [Path(p) for p in data["reports"]]
    assert [p.name.split("-")[3] for p in paths] == ["c1", "c4"]
    reports = [json.loads(p.read_text()) for p in paths]
    for report in reports:
        validate(report)
        assert report["repeat"]["n"] == 2 and len(report["repeat"]["runs"]) == 2
        runs = [r["output_throughput"] for r in report["repeat"]["runs"]]
        assert report["output_throughput"] == pytest.approx(sum(runs) / 2)  # median of 2
        assert report["repeat"]["spread"]["output_throughput"]["max"] == max(runs)
        assert len(report["ttfts"]) == 16  # raw arrays of both runs
    sweep = json.loads(Path(data["sweep"]).read_text())
    assert sweep["levels"] == ["1", "4"] and len(sweep["rows"]) == 2
    assert Path(data["sweep"]).with_suffix(".md").is_file()

    compared = bench("compare", *paths, "--json")
    assert compared.exit_code == 0, compared.output
    table = json.loads(compared.stdout)
    row = next(r for r in table["rows"] if r["metric"] == "output_throughput")
    assert row["ratios"][1] == pytest.approx(row["values"][1] / row["values"][0])
    assert row["deltas"][1] == pytest.approx(row["values"][1] - row["values"][0])
    assert row["spreads"][0] is not None and "medians" in table["note"]
    human = bench("compare", *paths)
    assert human.exit_code == 0 and "ratio" in human.output and "output_throughput" in human.output
    gated = bench("compare", *paths, "--gate", "completed>=1.0*reference",
                  "--gate", "p99_ttft_ms<=0.000001*reference")
    assert gated.exit_code == 1 and "FAIL" in gated.output


def test_nothing_to_benchmark_is_a_usage_error():
    result = bench()
    assert result.exit_code == 2 and "nothing to benchmark" in result.output
    assert "--target" in result.output


def test_compare_needs_reports(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    result = bench("compare", bad, bad)
    assert result.exit_code != 0 and "not a benchmark report" in result.output


def test_launched_server_is_started_and_stopped(tiny_llama, tmp_path):
    command = f"{shlex.quote(sys.executable)} {shlex.quote(str(FAKE_SERVER))} --port {{port}}"
    result = bench("--model", tiny_llama, "--server-command", command, "-n", 4, "--input-len",
                   8, "--output-len", 3, "--result-dir", tmp_path, "--no-plots")
    assert result.exit_code == 0, result.output
    report = only_report(tmp_path)
    engine = report["metadata"]["engine"]
    assert engine["launched"] and engine["command"][1] == str(FAKE_SERVER)
    assert report["completed"] == 4
    port = int(report["target"].rsplit(":", 1)[1])
    with socket.socket() as sock:  # stopped after the run
        assert sock.connect_ex(("127.0.0.1", port)) != 0


def test_launched_server_that_exits_reports_its_error(tiny_llama, tmp_path):
    command = (f"{shlex.quote(sys.executable)} -c "
               "\"import sys; print('error: no GPU here'); sys.exit(2)\"")
    result = bench("--model", tiny_llama, "--server-command", command, "-n", 2,
                   "--result-dir", tmp_path)
    assert result.exit_code == 1
    assert "exited with code 2" in result.output and "no GPU here" in result.output


def test_default_launch_is_llmctl_serve(tiny_llama, tmp_path):
    """Without --target, ``python -m llmctl serve MODEL --dtype D`` is started, with D the
    dtype auto resolves to on this machine (named in the report's command line)."""
    from llmctl.utils.device import default_device, resolve_dtype

    expected = resolve_dtype("auto", device=default_device()).dtype
    result = bench("--model", tiny_llama, "-n", 2, "--input-len", 8, "--output-len", 2,
                   "--result-dir", tmp_path, "--no-plots", "--server-timeout", 300)
    assert result.exit_code == 0, result.output
    assert f"server dtype auto -> {expected}" in result.output
    report = only_report(tmp_path)
    validate(report)
    assert report["completed"] == 2 and report["failed"] == 0
    command = report["metadata"]["engine"]["command"]
    assert command[1:4] == ["-m", "llmctl", "serve"]
    assert command[command.index("--dtype") + 1] == expected
    assert report["config"]["dtype"] == "auto"
    assert report["total_output_tokens"] == sum(report["output_lens"]) > 0


def test_dtype_is_only_for_the_server_bench_starts(tmp_path):
    result = bench("--target", "http://127.0.0.1:9", "--dtype", "float32", "--result-dir",
                   tmp_path)
    assert result.exit_code == 2 and "--dtype sets the dtype of the llmctl serve" in result.output


def test_secrets_stay_out_of_reports():
    from llmctl.bench.config import options_from_flags

    opts = options_from_flags(model="m", serve_args="--api-key s3cret --max-num-seqs 4",
                              server_command="srv --api-key=s3cret --port {port}")
    dumped = json.dumps(opts.model_dump(mode="json"))
    assert "s3cret" not in dumped and "--api-key ***" in dumped
    assert opts.serve_args.startswith("--api-key s3cret")  # the server itself gets the key


def test_target_dying_still_writes_a_report(tiny_llama, tmp_path):
    with fake_server("--ttft-ms", "2", "--itl-ms", "2", "--die-after", "3") as (url, _):
        result = small(url, tiny_llama, tmp_path, "--max-concurrency", 1, "--no-plots")
    assert result.exit_code == 1 and "went down" in result.output
    report = only_report(tmp_path)
    validate(report)
    # Request 1 is the initial test, 2 completes, 3 kills the server.
    assert report["target_down"] and report["completed"] == 1
    assert report["completed"] + report["failed"] == report["num_requests"] == 8


def test_ctrl_c_writes_a_partial_report(server, tiny_llama, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmctl", "bench", "--target", server, "--model",
         str(tiny_llama), "-n", "200", "--input-len", "8", "--output-len", "4",
         "--request-rate", "5", "--result-dir", str(tmp_path), "--no-plots"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        for line in proc.stderr:  # wait until the measurement has started
            if "benchmarking" in line:
                break
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    report = only_report(tmp_path)
    validate(report)
    assert report["interrupted"] and 0 < report["num_requests"] < 200
    assert report["completed"] + report["failed"] == report["num_requests"]
