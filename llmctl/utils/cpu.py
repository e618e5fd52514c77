"""What the CPU can do, read from ``/proc/cpuinfo`` (no torch import)."""
from __future__ import annotations

from pathlib import Path


def cpu_flags() -> frozenset[str]:
    """The ISA flags the kernel reports (``flags`` on x86, ``Features`` on Arm), empty
    where unknown (not Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
