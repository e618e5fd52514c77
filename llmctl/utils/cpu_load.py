"""How much CPU work other processes did while we measured, from ``/proc``.

The 1-minute load average cannot judge a measurement: it lags by a minute and counts our
own threads (2 threads on 2 cores put it near 2 on a quiet machine). Instead: the CPU time
the machine spent *outside this process tree* between two samples, from ``/proc/stat``
(all CPUs, including time stolen by the hypervisor) minus ``/proc/<pid>/stat`` of this
process and its descendants, in cores' worth of work:
``foreign = (busy + steal - ours) / ticks per second / wall``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

# A quarter of a core of other work, averaged over a measurement, is enough to move a
# memory-bound 2-thread benchmark by several percent (and an OpenMP pool that busy-waits
# by far more); a quiet VM shows ~0.01-0.05 (sshd, the kernel's own threads).
FOREIGN_CORES_LIMIT = 0.25


@dataclass(frozen=True)
class CpuSample:
    """Clock ticks of the whole machine and of this process tree, at one time."""

    wall: float
    busy: int  # all CPUs: user + nice + system + irq + softirq (guest is inside user)
    steal: int  # time the hypervisor gave this VM's CPUs to someone else
    ours: int  # this process and its descendants: utime + stime + cutime + cstime
    load: tuple[float, float, float]


def foreign_cores(start: CpuSample, end: CpuSample, ticks_per_second: float) -> float | None:
    """Cores' worth of work outside our process tree between two samples."""
    wall = end.wall - start.wall
    if wall <= 0:
        return None
    foreign = (end.busy - start.busy) + (end.steal - start.steal) - (end.ours - start.ours)
    return max(foreign, 0) / ticks_per_second / wall


def _machine_ticks() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal


def _tree_ticks(root: int) -> int:
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:  # exited while we walked
            continue
        # fields after "(comm)": state ppid ... utime(14) stime(15) cutime(16) cstime(17)
        rest = text[text.rindex(")") + 2:].split()
        pid = int(entry.name)
        parents[pid] = int(rest[1])
        ticks[pid] = sum(int(x) for x in rest[11:15])
    total = 0
    for pid, own in ticks.items():
        node = pid
        while node and node != root and node in parents:
            node = parents[node]
        if node == root:
            total += own
    return total


def sample() -> CpuSample | None:
    """Now, or None without ``/proc`` (not Linux)."""
    try:
        busy, steal = _machine_ticks()
        ours = _tree_ticks(os.getpid())
    except (OSError, ValueError):
        return None
    return CpuSample(time.perf_counter(), busy, steal, ours, os.getloadavg())


def foreign_since(start: CpuSample | None) -> float | None:
    """Cores' worth of other work from ``start`` until now (None without ``/proc``)."""
    end = sample()
    if start is None or end is None:
        return None
    return foreign_cores(start, end, os.sysconf("SC_CLK_TCK"))
