"""``llmctl hw probe`` / ``llmctl hw show`` through Typer's CliRunner, in a fresh
LLMCTL_HOME: one real --quick probe, the rest on records written by hand."""

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from llmctl.cli.app import build_app
from llmctl.hw import probe as probe_module
from llmctl.perf import probe_record as pr
from llmctl.utils.cpu import cpu_flags, usable_cpus
from llmctl.utils.device import native_bf16

runner = CliRunner()
app = build_app()
JSON_KEYS = {"cached", "measured_at", "path", "key", "quick", "summary", "peaks", "measurements",
             "kernels"}


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCTL_HOME", str(tmp_path))
    return tmp_path


def run(*args):
    return runner.invoke(app, ["hw", *map(str, args)])


def record(quick: bool) -> pr.ProbeRecord:
    return pr.ProbeRecord(
        pr.current_key(1), "2026-11-24T12:00:00+00:00",
        (pr.Measurement("read", "torch.sum", "over 512 MiB of bf16", 60e9, (1.0,)),
         pr.Measurement("bf16", "own kernel", "512 x 576 x 576", 440e9, (1.0,))),
        memory_bytes=10 ** 9, quick=quick)


def test_probe_quick_then_show(home):
    result = run("show", "--threads", 1)
    assert result.exit_code == 1
    assert "no cached probe for" in result.output and "run `llmctl hw probe`" in result.output

    result = run("probe", "--quick", "--threads", 1, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) == JSON_KEYS
    assert data["cached"] is False and data["quick"] is True and data["key"]["threads"] == 1
    # one thread; bf16 is emulated without AVX512-BF16/AMX (AMD Zen 3: ~0.85 GFLOP/s)
    assert data["peaks"]["flops"]["bf16"] > (1e9 if native_bf16() else 1e8)
    assert 1e9 < data["peaks"]["bandwidth"] < 1e12
    assert data["peaks"]["source"].startswith("probe: ")
    kernels = data["kernels"]  # the engine's kernel build: the best variant this CPU runs
    assert kernels["variant"] == "native" and kernels["bodies"] == kernels["cpu_runs"][0]
    assert kernels["cpu_runs"][-1] == "portable"
    assert (kernels["bodies"] == "avx2") == ({"avx2", "fma"} <= cpu_flags()
                                             and "avx512f" not in cpu_flags())
    units = {row["peak"]: row["unit"] for row in data["summary"]}
    assert units["read bandwidth"] == "GB/s" and units["bf16 matmul"] == "GFLOP/s"
    assert (home / "hw").is_dir() and data["path"].startswith(str(home / "hw"))

    shown = json.loads(run("show", "--threads", 1, "--json").stdout)
    assert shown["cached"] is True and shown["measured_at"] == data["measured_at"]
    assert shown["peaks"] == data["peaks"]

    # cached: printed, not measured (unless contended: mark it quiet, neighbours vary)
    saved = pr.load(pr.current_key(1)).record
    pr.save(dataclasses.replace(saved, measurements=tuple(
        dataclasses.replace(m, foreign_cores=0.0) for m in saved.measurements)))
    again = run("probe", "--quick", "--threads", 1)
    assert again.exit_code == 0, again.output
    assert f"cached probe from {data['measured_at']}" in again.output
    for text in ("GB/s", "GFLOP/s", "source: probe: "):
        assert text in again.output


def test_a_cached_quick_probe_is_measured_again_without_quick(home, monkeypatch):
    calls = []

    def fake_measure(threads, *, quick):
        calls.append((threads, quick))
        return record(quick)

    monkeypatch.setattr(probe_module, "measure", fake_measure)
    pr.save(record(quick=True))
    assert run("probe", "--threads", 1, "--quick").exit_code == 0 and calls == []
    result = run("probe", "--threads", 1)
    assert result.exit_code == 0, result.output
    assert calls == [(1, False)] and "measured now" in result.output
    assert run("probe", "--threads", 1, "--quick").exit_code == 0 and len(calls) == 1
    assert run("probe", "--threads", 1, "--force").exit_code == 0 and len(calls) == 2


def test_show_reads_the_table_of_a_saved_record(home):
    pr.save(record(quick=False))
    result = run("show", "--threads", 1)
    assert result.exit_code == 0, result.output
    assert "60.0 GB/s" in result.output and "440.0 GFLOP/s" in result.output
    assert "cached probe from 2026-11-24T12:00:00+00:00" in result.output
    assert "memory: 1.0 GB" in result.output


def test_a_corrupt_cache_is_ignored_and_said_so(home):
    path = pr.save(record(quick=False))
    path.write_text("{broken")
    result = run("show", "--threads", 1)
    assert result.exit_code == 1
    assert "ignoring the cached probe" in result.output and "not valid JSON" in result.output
    assert "run `llmctl hw probe`" in result.output


@pytest.mark.skipif(usable_cpus() < 2, reason="needs a second CPU for another thread count")
def test_show_names_the_thread_counts_that_have_a_probe(home):
    pr.save(record(quick=False))
    result = run("show", "--threads", 2)
    assert result.exit_code == 1
    assert "cached for --threads 1" in result.output


@pytest.mark.parametrize("command", ["probe", "show"])
@pytest.mark.parametrize("threads,expected", [
    (0, "greater than or equal to 1"),
    (usable_cpus() + 1, f"more than the {usable_cpus()} CPUs"),
])
def test_bad_thread_counts_exit_2_with_one_line(home, command, threads, expected):
    result = run(command, "--threads", threads)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 2 and lines[0].startswith("error: ") and "--threads" in lines[0]
    assert expected in lines[0] and lines[1].strip().startswith("hint:")
    assert not (home / "hw").exists()  # nothing measured, nothing written


def test_a_contended_probe_is_shown_with_a_warning_and_measured_again(home, monkeypatch):
    quiet = record(quick=False)
    busy = pr.Measurement("read", "torch.sum", "over 512 MiB of bf16", 60e9, (1.0,),
                          foreign_cores=0.9)
    pr.save(pr.ProbeRecord(quiet.key, quiet.measured_at, (busy, *quiet.measurements[1:])))
    result = run("show", "--threads", 1)
    assert result.exit_code == 0, result.output
    assert "warning: contended: other processes used up to 0.90 cores" in result.output
    assert "2026-11-24, contended" in result.output
    calls = []
    monkeypatch.setattr(probe_module, "measure",
                        lambda threads, *, quick: calls.append(quick) or quiet)
    assert run("probe", "--threads", 1, "--quick").exit_code == 0 and calls == [True]
    assert "contended" not in run("show", "--threads", 1).output  # the new probe replaced it


def test_show_names_the_kernel_variant_and_why(home, monkeypatch):
    """Without a cached probe `hw show` still says which kernel build the engine uses;
    LLMCTL_KERNEL_ISA picks another variant the CPU runs."""
    result = run("show", "--threads", 1)
    assert result.exit_code == 1
    assert "engine kernels: " in result.output and "-march=native on this CPU" in result.output
    monkeypatch.setenv("LLMCTL_KERNEL_ISA", "portable")
    result = run("show", "--threads", 1)
    assert "engine kernels: portable bodies (LLMCTL_KERNEL_ISA=portable)" in result.output


def test_an_arm_cpu_is_said_to_run_the_neon_bodies(monkeypatch):
    from llmctl.serve.kernels import cpu as cpu_kernels

    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "aarch64")
    monkeypatch.delenv("LLMCTL_KERNEL_ISA", raising=False)
    monkeypatch.delenv("LLMCTL_CPU_KERNELS", raising=False)
    described = cpu_kernels.describe_variant()
    assert described["cpu_runs"] == ["portable"] and described["bodies"] == "portable"
    assert "aarch64: NEON paged attention" in described["why"]
