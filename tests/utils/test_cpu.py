"""The machine facts read from /sys, on fake /sys trees."""

import pytest

from llmctl.utils.cpu import last_level_cache, parse_cache_size


@pytest.mark.parametrize("text,expected", [("32K", 32 * 1024), ("32768K\n", 32 * 1024 ** 2),
                                           ("1M", 1024 ** 2), ("512", 512)])
def test_parse_cache_size(text, expected):
    assert parse_cache_size(text) == expected


def _cache(root, cpu, index, level, kind, size, shared):
    path = root / f"cpu{cpu}" / "cache" / f"index{index}"
    path.mkdir(parents=True)
    for name, value in (("level", level), ("type", kind), ("size", size),
                        ("shared_cpu_list", shared)):
        (path / name).write_text(f"{value}\n")


def test_a_shared_last_level_cache_counts_once(tmp_path):
    for cpu in (0, 1):
        _cache(tmp_path, cpu, 0, 1, "Data", "32K", cpu)
        _cache(tmp_path, cpu, 1, 1, "Instruction", "32K", cpu)
        _cache(tmp_path, cpu, 2, 2, "Unified", "1024K", cpu)
        _cache(tmp_path, cpu, 3, 3, "Unified", "32768K", "0-1")
    assert last_level_cache(tmp_path) == (3, 32 * 1024 ** 2)


def test_one_last_level_cache_per_ccx_is_summed(tmp_path):
    for cpu in range(4):  # two CCXs of two CPUs, 32 MiB of L3 each
        _cache(tmp_path, cpu, 0, 2, "Unified", "1024K", cpu)
        _cache(tmp_path, cpu, 1, 3, "Unified", "32768K", "0-1" if cpu < 2 else "2-3")
    assert last_level_cache(tmp_path) == (3, 64 * 1024 ** 2)


def test_no_cache_information_is_none(tmp_path):
    assert last_level_cache(tmp_path) is None


def test_flags_cap_reports_an_avx2_only_cpu(monkeypatch):
    from llmctl.utils import cpu

    real = frozenset({"sse2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw",
                      "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "avx_vnni"})
    monkeypatch.setattr(cpu.Path, "read_text",
                        lambda self: "processor: 0\nflags\t\t: " + " ".join(sorted(real)) + "\n")
    assert cpu.cpu_flags() == real
    monkeypatch.setenv(cpu.FLAGS_CAP_ENV, "x86-64-v3")
    assert cpu.cpu_flags() == {"sse2", "avx", "avx2", "fma", "f16c", "bmi2"}


def test_an_unknown_flags_cap_is_a_usage_error(monkeypatch):
    from llmctl.errors import UsageError
    from llmctl.utils import cpu

    monkeypatch.setenv(cpu.FLAGS_CAP_ENV, "avx2")
    with pytest.raises(UsageError, match="x86-64-v3"):
        cpu.cpu_flags()
