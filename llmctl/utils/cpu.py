"""What the CPU can do, read from ``/proc/cpuinfo`` and ``/sys`` (no torch import)."""
from __future__ import annotations

import os
import platform
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")
# /sys cache sizes: "32K", "1024K", "32768K"; some kernels write "1M"
_SIZE_UNITS = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}


# $LLMCTL_CPU_FLAGS_CAP=x86-64-v3: report the CPU as an AVX2-only one (AMD Zen 3) would be
# seen, dropping every flag above x86-64-v3 (AVX-512, AMX, AVX-VNNI, ...). With torch's own
# caps (benchmarks/as_avx2 sets them all) an AVX-512 machine then takes the decisions and
# the code paths of an AVX2-only CPU: a development stand-in, never a measurement of one.
FLAGS_CAP_ENV = "LLMCTL_CPU_FLAGS_CAP"
_ABOVE_V3 = ("avx512", "amx_", "avx_vnni", "avx_ifma", "avx_ne_convert")


def cpu_flags() -> frozenset[str]:
    """The ISA flags the kernel reports (``flags`` on x86, ``Features`` on Arm), empty
    where unknown (not Linux); capped by ``$LLMCTL_CPU_FLAGS_CAP`` (above)."""
    flags: frozenset[str] = frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = frozenset(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    cap = os.environ.get(FLAGS_CAP_ENV, "")
    if not cap:
        return flags
    if cap != "x86-64-v3":
        from llmctl.errors import UsageError

        raise UsageError(f"{FLAGS_CAP_ENV}={cap}: not a known cap", "use x86-64-v3 or unset it")
    return frozenset(f for f in flags if not f.startswith(_ABOVE_V3))


def cpu_model() -> str:
    """The model name the kernel reports ("AMD EPYC 9B14"), else the platform's guess."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def ram_bytes() -> int | None:
    """Total physical memory, None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def available_ram_bytes() -> int | None:
    """Memory that can be allocated without swapping (``MemAvailable``), None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def parse_cache_size(text: str) -> int:
    """Bytes of a ``/sys/.../cache/index*/size`` value: "32768K" -> 33554432."""
    text = text.strip()
    unit = _SIZE_UNITS.get(text[-1:].upper())
    return int(text[:-1]) * unit if unit else int(text)


def last_level_cache(root: Path = SYS_CPU) -> tuple[int, int] | None:
    """``(level, total bytes)`` of the largest cache level, summed over its instances (a
    cache shared by CPUs 0-7 counts once, not eight times), None where ``/sys`` does not
    say (not Linux, some containers)."""
    instances: dict[tuple[int, str], int] = {}  # (level, shared CPUs) -> bytes
    for index in sorted(root.glob("cpu[0-9]*/cache/index[0-9]*")):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            shared = (index / "shared_cpu_list").read_text().strip()
            instances[(level, shared)] = parse_cache_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
    if not instances:
        return None
    top = max(level for level, _ in instances)
    return top, sum(size for (level, _), size in instances.items() if level == top)
