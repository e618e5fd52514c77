"""The CPU probe: the pure parts (key, measurements -> Peaks, cache) against hand-computed
values, and one real --quick probe against plausibility bounds."""

import dataclasses
import json

import pytest

from llmctl.hw.probe import PLANS, plan_for
from llmctl.perf import probe_record as pr
from llmctl.perf.probe_record import check_threads
from llmctl.utils.cpu import usable_cpus

MiB = 1024 ** 2
ZEN4 = {"fpu", "sse2", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "sha_ni"}


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCTL_HOME", str(tmp_path))
    return tmp_path


def key(threads=2, torch="2.13.0+cpu", flags=frozenset(ZEN4)):
    return pr.machine_key("AMD EPYC 9B14", flags, threads, torch)


def fake_record(threads=2, quick=False) -> pr.ProbeRecord:
    """Work and seconds chosen so every rate is a round number."""
    return pr.ProbeRecord(
        key(threads), "2026-11-24T12:00:00+00:00",
        (pr.Measurement("read", "torch.sum", "over 512 MiB of bf16", 60e9, (1.2, 1.0, 1.5)),
         pr.Measurement("copy", "Tensor.copy_", "of 256 MiB into 256 MiB", 40e9, (1.0, 2.0)),
         pr.Measurement("fp32", "torch.matmul", "2048^3", 200e9, (1.0, 1.0, 1.25)),
         pr.Measurement("bf16", "torch.matmul", "2048^3", 400e9, (1.0, 1.1, 1.2)),
         pr.Measurement("bf16", "own kernel", "512 x 576 x 576", 440e9, (1.1, 1.0, 1.0))),
        memory_bytes=25 * 10 ** 9, quick=quick, notes=("int8: no peak",))


# --- the key -----------------------------------------------------------------------------
def test_the_key_keeps_only_the_flags_that_move_a_peak():
    k = key()
    assert k.isa == ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni")  # PEAK_FLAGS order
    assert k.isa_summary() == "avx512_bf16, no amx"
    assert k.describe() == "AMD EPYC 9B14 (avx512_bf16, no amx), 2 threads, torch 2.13.0+cpu"
    # a flag outside PEAK_FLAGS does not change the key; threads, torch, a peak flag do
    assert key(flags=frozenset(ZEN4 | {"rdrand"})).digest() == k.digest()
    others = {key(threads=1).digest(), key(torch="2.14.0").digest(),
              key(flags=frozenset(ZEN4 | {"amx_tile", "amx_bf16"})).digest(), k.digest()}
    assert len(others) == 4


def test_isa_summary_names_the_best_bf16_unit():
    assert key(flags=frozenset({"avx512f", "amx_tile", "amx_bf16"})).isa_summary() == "amx_bf16"
    assert key(flags=frozenset({"avx2", "fma"})).isa_summary() == "avx2, no amx"
    assert key(flags=frozenset({"asimd", "sve", "bf16"})).isa_summary() == "sve"  # Arm: no AMX


# --- measurements -> Peaks -------------------------------------------------------------------
def test_a_measurement_reports_best_median_and_worst_with_units():
    m = pr.Measurement("bf16", "torch.matmul", "2048 x 2048 x 2048", 2e9, (1.0, 0.5, 2.0))
    assert (m.best, m.median, m.worst) == (4e9, 2e9, 1e9)
    assert m.note() == ("bf16: torch.matmul 2048 x 2048 x 2048, 3 runs: best 4.0, median 2.0, "
                        "worst 1.0 GFLOP/s")
    read = pr.Measurement("read", "torch.sum", "over 1 GiB", 3e9, (0.1,))
    assert read.note().endswith("30.0 GB/s")
    assert pr.Measurement("int8", "torch._int_mm", "n", 1e9, (1.0,)).note().endswith("GOP/s")
    with pytest.raises(ValueError, match="unknown measurement kind 'fp64'.*known: read"):
        pr.Measurement("fp64", "x", "y", 1.0, (1.0,))
    with pytest.raises(ValueError, match="positive run times"):
        pr.Measurement("read", "x", "y", 1.0, (0.0,))


def test_peaks_from_fake_measurements():
    peaks = fake_record().peaks()
    assert peaks.flops == {"fp32": 200e9, "bf16": 440e9}  # bf16: own kernel beats matmul
    assert peaks.flops_for("int8") is None
    assert peaks.bandwidth == 60e9  # the best read, not the copy
    assert peaks.memory_bytes == 25 * 10 ** 9
    assert peaks.source == "probe: AMD EPYC 9B14 (avx512_bf16, no amx), 2 threads, 2026-11-24"
    assert "copy: Tensor.copy_ of 256 MiB into 256 MiB, 2 runs: best 40.0, median 26.7, " \
           "worst 20.0 GB/s" in peaks.notes
    assert "read: torch.sum over 512 MiB of bf16, 3 runs: best 60.0, median 50.0, worst " \
           "40.0 GB/s" in peaks.notes
    assert "bf16 peak: the fastest of torch.matmul 400.0, own kernel 440.0 GFLOP/s" in peaks.notes
    assert peaks.notes[-1] == "int8: no peak"
    assert fake_record(threads=1, quick=True).peaks().source.endswith("1 thread, 2026-11-24, quick")


def test_a_contended_measurement_is_said_in_the_source_and_notes():
    quiet = fake_record()
    busy = dataclasses.replace(quiet, measurements=(
        dataclasses.replace(quiet.measurements[0], foreign_cores=0.91),
        dataclasses.replace(quiet.measurements[1], foreign_cores=0.05),  # below the limit
        *quiet.measurements[2:]))
    assert quiet.contention_note() is None and not quiet.peaks().source.endswith("contended")
    peaks = busy.peaks()
    assert peaks.source.endswith("2026-11-24, contended")
    assert peaks.notes[0] == ("contended: other processes used up to 0.91 cores during read "
                              "torch.sum; those peaks read low (run `llmctl hw probe --force` "
                              "on an idle machine)")
    assert peaks.notes[1].endswith("40.0 GB/s (contended: 0.91 cores of other work)")
    assert peaks.notes[2].endswith("20.0 GB/s")  # the copy, 0.05 cores: quiet
    assert pr.ProbeRecord.from_dict(busy.to_dict()) == busy


def test_summary_rows_carry_display_units():
    rows = {r["peak"]: r for r in fake_record().summary()}
    assert list(rows) == ["read bandwidth", "copy bandwidth (read + written)", "fp32 matmul",
                          "bf16 matmul"]
    assert (rows["read bandwidth"]["value"], rows["read bandwidth"]["unit"]) == (60.0, "GB/s")
    assert rows["bf16 matmul"] == {"peak": "bf16 matmul", "value": 440.0, "unit": "GFLOP/s",
                                   "path": "own kernel", "what": "512 x 576 x 576"}


# --- the cache ---------------------------------------------------------------------------------
def test_save_and_load_roundtrip(home):
    record = fake_record()
    path = pr.save(record)
    assert path.parent == home / "hw" and path.name == f"probe-{record.key.digest()}.json"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left
    lookup = pr.load(record.key)
    assert lookup.record == record and lookup.problem is None
    assert lookup.record.peaks() == record.peaks()
    assert pr.load(key(threads=1)) == pr.CacheLookup(pr.cache_path(key(threads=1)), None)
    assert pr.cached_keys() == [record.key]


@pytest.mark.parametrize("content,problem", [
    ("{not json", "not valid JSON"),
    ('{"format": 0, "key": {}}', "written in format 0, this llmctl reads format 1"),
    ('[1, 2]', "written in format None"),
    ('{"format": 1, "key": {"cpu": "x"}}', "incomplete or malformed (KeyError"),
])
def test_a_corrupt_or_old_cache_file_reads_as_missing_and_says_why(home, content, problem):
    k = key()
    pr.cache_dir().mkdir(parents=True, exist_ok=True)
    pr.cache_path(k).write_text(content)
    lookup = pr.load(k)
    assert lookup.record is None and problem in lookup.problem
    assert pr.cached_keys() == []


def test_a_file_holding_another_key_is_not_used(home):
    k = key()
    data = fake_record(threads=1).to_dict()
    pr.cache_dir().mkdir(parents=True, exist_ok=True)
    pr.cache_path(k).write_text(json.dumps(data))
    lookup = pr.load(k)
    assert lookup.record is None and "another machine" in lookup.problem


def test_cached_peaks_is_none_without_or_with_a_corrupt_cache(home):
    from llmctl.perf.probe_record import cached_peaks, current_key

    assert cached_peaks(1) is None
    path = pr.cache_path(current_key(1))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("garbage")
    assert cached_peaks(1) is None
    record = pr.ProbeRecord(current_key(1), "2026-11-24T00:00:00+00:00",
                            fake_record().measurements)
    pr.save(record)
    assert cached_peaks(1) == record.peaks()


# --- the plan ------------------------------------------------------------------------------
def test_the_read_buffer_is_at_least_eight_times_the_last_level_cache():
    assert plan_for(False, (3, 32 * MiB), 20_000 * MiB).buffer_bytes == 512 * MiB
    assert plan_for(False, (3, 256 * MiB), 20_000 * MiB).buffer_bytes == 2048 * MiB
    assert plan_for(True, (3, 32 * MiB), None).buffer_bytes == 256 * MiB
    short = plan_for(False, (3, 32 * MiB), 800 * MiB)  # a quarter of free memory at most
    assert short.buffer_bytes == 200 * MiB
    assert short.notes == (("read buffer only 6.2x the L3 (free memory is short): the "
                            "bandwidths may include cache hits"),)
    assert "cache sizes unknown" in plan_for(True, None, None).notes[0]
    assert PLANS[True][1] < PLANS[False][1] and PLANS[True][3] < PLANS[False][3]


def test_thread_counts_outside_the_usable_cpus_are_refused():
    assert check_threads(1) == 1
    for bad in (0, usable_cpus() + 1):
        with pytest.raises(ValueError, match="between 1 and the"):
            check_threads(bad)


# --- one real probe ----------------------------------------------------------------------------
def test_a_quick_probe_measures_plausible_numbers():
    import torch

    from llmctl.hw.probe import INT8_DOT_FLAGS, measure
    from llmctl.serve.kernels.cpu import gemm_bf16_kernel
    from llmctl.utils.cpu import cpu_flags
    from llmctl.utils.device import native_bf16

    gemm_bf16_kernel()  # the one-time build of llmctl's kernels (seconds) is not the probe's
    threads = torch.get_num_threads()
    record = measure(1, quick=True)
    assert torch.get_num_threads() == threads  # restored
    peaks = record.peaks()
    assert 1e9 < peaks.bandwidth < 1e12
    assert 1e9 < record.best("copy").best < 1e12
    # one thread; bf16 is emulated without AVX512-BF16/AMX (AMD Zen 3: ~0.85 GFLOP/s)
    assert peaks.flops["bf16"] > (1e9 if native_bf16() else 1e8) and peaks.flops["fp32"] > 1e9
    if hasattr(torch, "_int_mm"):  # without VNNI/AMX torch's int8 product is ~1 GFLOP/s
        vnni = any(flag in cpu_flags() for flag in INT8_DOT_FLAGS)
        assert peaks.flops["int8"] > (1e9 if vnni else 1e8)
    assert record.key.threads == 1 and record.quick
    assert peaks.source.startswith("probe: ") and "1 thread, " in peaks.source
    assert all(m.foreign_cores is not None and m.foreign_cores >= 0
               for m in record.measurements)  # Linux: /proc is there
    kinds = {m.kind for m in record.measurements}
    assert {"read", "copy", "fp32", "bf16"} <= kinds
    assert all(len(m.seconds) == PLANS[True][3] for m in record.measurements)
    # No wall-clock bound (a timed unit test measures the machine, not the code: on an Intel
    # Xeon with a 300 MiB L3 the read buffer is 8x that, 2.4 GB, and the probe took 6.7 s);
    # quick is the quick plan's sizes and repeats, checked above and in plan_for's tests.
