"""What ``llmctl hw probe`` measured, the :class:`~llmctl.perf.peaks.Peaks` it makes, and
the cache that keeps it per machine under ``$LLMCTL_HOME/hw/``.

No timing here (:mod:`llmctl.hw.probe` measures; torch is imported only for its version
and thread count in :func:`current_key`): a record is a
:class:`MachineKey` (what the peaks depend on), the time, and the raw
:class:`Measurement` s (work per run and every run's seconds), so the peak (best run),
median and spread are all derived, never stored twice.

Cache files are ``hw/probe-<key digest>.json``; a file that does not parse, was written
in another format, or holds another key reads as missing, with the reason
(:class:`CacheLookup`), so the CLI can say why it measures again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from llmctl.home import llmctl_home
from llmctl.perf.peaks import Peaks
from llmctl.utils.atomic import write_text
from llmctl.utils.cpu import cpu_flags, cpu_model, usable_cpus
from llmctl.utils.cpu_load import FOREIGN_CORES_LIMIT

log = logging.getLogger("llmctl.perf")

FORMAT = 1  # bump when a field changes meaning: older files then read as missing

# The ISA flags a peak depends on (which vector / matrix units the GEMMs can use), in the
# order the key lists them: x86 first, then Arm. Any other flag does not move a peak.
PEAK_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "avx_vnni",
              "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
              "asimd", "sve", "sve2", "bf16", "i8mm", "sme")
# The best bf16 matrix unit present names the machine in a peak's source, strongest first.
BF16_UNITS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2", "sve", "asimd")

# kind -> (unit of work per second, display scale, display unit). Reads and copies count
# bytes; fp32/bf16 products count FLOPs (2 per multiply-add); int8 ones ops (same count).
UNITS = {
    "read": ("B/s", 1e9, "GB/s"),
    "copy": ("B/s", 1e9, "GB/s"),
    "fp32": ("FLOP/s", 1e9, "GFLOP/s"),
    "bf16": ("FLOP/s", 1e9, "GFLOP/s"),
    "int8": ("OP/s", 1e9, "GOP/s"),
}
LABELS = {"read": "read bandwidth", "copy": "copy bandwidth (read + written)",
          "fp32": "fp32 matmul", "bf16": "bf16 matmul", "int8": "int8 matmul"}


@dataclass(frozen=True)
class MachineKey:
    """What a probe's peaks depend on: a cached probe is reused only when all match."""

    cpu: str
    isa: tuple[str, ...]  # the PEAK_FLAGS this CPU has
    threads: int
    torch: str

    def digest(self) -> str:
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def isa_summary(self) -> str:
        """"avx512_bf16, no amx": the best bf16 unit, and whether AMX is missing on x86."""
        best = next((flag for flag in BF16_UNITS if flag in self.isa), None)
        parts = [best or "no SIMD flags known"]
        if any(flag.startswith("avx") for flag in self.isa) and "amx_tile" not in self.isa:
            parts.append("no amx")
        return ", ".join(parts)

    def describe(self) -> str:
        return (f"{self.cpu} ({self.isa_summary()}), {self.threads} "
                f"thread{'s' if self.threads != 1 else ''}, torch {self.torch}")

    def to_dict(self) -> dict:
        return {"cpu": self.cpu, "isa": list(self.isa), "threads": self.threads,
                "torch": self.torch}

    @classmethod
    def from_dict(cls, data: dict) -> MachineKey:
        return cls(str(data["cpu"]), tuple(data["isa"]), int(data["threads"]), str(data["torch"]))


def machine_key(cpu: str, flags: frozenset[str] | set[str], threads: int,
                torch_version: str) -> MachineKey:
    """The key of a machine with these ``/proc/cpuinfo`` flags (only PEAK_FLAGS count)."""
    return MachineKey(cpu, tuple(flag for flag in PEAK_FLAGS if flag in flags), threads,
                      torch_version)


@dataclass(frozen=True)
class Measurement:
    """One quantity timed ``len(seconds)`` times (after an untimed warm-up run), each run
    doing ``work`` bytes or FLOPs: ``kind`` is "read", "copy" or a dtype."""

    kind: str
    path: str  # what ran: "torch.sum", "torch.matmul", "oneDNN packed linear", "own kernel"
    what: str  # the size: "512 MiB of bf16 (16x the 32 MiB L3)", "2048 x 2048 x 2048"
    work: float
    seconds: tuple[float, ...]
    foreign_cores: float | None = None  # other processes' CPU use meanwhile (cpu_load)

    def __post_init__(self) -> None:
        if self.kind not in UNITS:
            raise ValueError(f"unknown measurement kind {self.kind!r}; known: {', '.join(UNITS)}")
        if not self.seconds or min(self.seconds) <= 0:
            raise ValueError(f"{self.kind} {self.path}: needs positive run times, got "
                             f"{self.seconds}")

    @property
    def best(self) -> float:
        """The peak: work over the fastest run (per second)."""
        return self.work / min(self.seconds)

    @property
    def median(self) -> float:
        return self.work / statistics.median(self.seconds)

    @property
    def worst(self) -> float:
        return self.work / max(self.seconds)

    @property
    def contended(self) -> bool:
        return self.foreign_cores is not None and self.foreign_cores > FOREIGN_CORES_LIMIT

    def note(self) -> str:
        """``bf16 torch.matmul 2048 x 2048 x 2048, 7 runs: best 431.2, median 425.0, worst
        398.1 GFLOP/s``: what ``llmctl hw probe`` says it measured."""
        _, scale, unit = UNITS[self.kind]
        busy = (f" (contended: {self.foreign_cores:.2f} cores of other work)"
                if self.contended else "")
        return (f"{self.kind}: {self.path} {self.what}, {len(self.seconds)} runs: best "
                f"{self.best / scale:.1f}, median {self.median / scale:.1f}, worst "
                f"{self.worst / scale:.1f} {unit}{busy}")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "path": self.path, "what": self.what, "work": self.work,
                "seconds": list(self.seconds), "foreign_cores": self.foreign_cores}

    @classmethod
    def from_dict(cls, data: dict) -> Measurement:
        foreign = data.get("foreign_cores")
        return cls(str(data["kind"]), str(data["path"]), str(data["what"]), float(data["work"]),
                   tuple(float(s) for s in data["seconds"]),
                   None if foreign is None else float(foreign))


@dataclass(frozen=True)
class ProbeRecord:
    """One probe of one machine: the measurements and what was left out (``notes``)."""

    key: MachineKey
    measured_at: str  # ISO 8601, UTC
    measurements: tuple[Measurement, ...]
    memory_bytes: int | None = None
    quick: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)  # what was not measured, and why

    def best(self, kind: str) -> Measurement | None:
        """The fastest path measured for ``kind`` (a dtype, "read" or "copy")."""
        found = [m for m in self.measurements if m.kind == kind]
        return max(found, key=lambda m: m.best) if found else None

    def contended(self) -> tuple[Measurement, ...]:
        """The measurements other processes disturbed (their peaks read low)."""
        return tuple(m for m in self.measurements if m.contended)

    def source(self) -> str:
        """``probe: AMD EPYC 9B14 (avx512_bf16, no amx), 2 threads, 2026-11-24``, plus
        ", quick" and ", contended" when they apply (shown beside every utilization)."""
        threads = f"{self.key.threads} thread{'s' if self.key.threads != 1 else ''}"
        flags = (", quick" if self.quick else "") + (", contended" if self.contended() else "")
        return (f"probe: {self.key.cpu} ({self.key.isa_summary()}), {threads}, "
                f"{self.measured_at[:10]}{flags}")

    def contention_note(self) -> str | None:
        """What to say about a disturbed probe, None for a quiet one."""
        busy = self.contended()
        if not busy:
            return None
        worst = max(m.foreign_cores for m in busy)
        return (f"contended: other processes used up to {worst:.2f} cores during "
                + ", ".join(f"{m.kind} {m.path}" for m in busy)
                + "; those peaks read low (run `llmctl hw probe --force` on an idle machine)")

    def summary(self) -> list[dict]:
        """One row per peak: ``{"peak", "value", "unit", "path", "what"}`` in display
        units (GB/s, GFLOP/s, GOP/s), fastest path per kind, in UNITS order."""
        rows = []
        for kind, (_, scale, unit) in UNITS.items():
            m = self.best(kind)
            if m is not None:
                rows.append({"peak": LABELS[kind], "value": round(m.best / scale, 1),
                             "unit": unit, "path": m.path, "what": m.what})
        return rows

    def peaks(self) -> Peaks:
        """Peaks: per dtype the best run of the fastest path, read bandwidth the best
        read; copy bandwidth, every run and what was left out go in the notes."""
        flops = {kind: m.best for kind in ("fp32", "bf16", "int8")
                 if (m := self.best(kind)) is not None}
        read = self.best("read")
        busy = self.contention_note()
        notes = ([busy] if busy else []) + [m.note() for m in self.measurements]
        for kind in flops:
            paths = [m for m in self.measurements if m.kind == kind]
            if len(paths) > 1:
                _, scale, unit = UNITS[kind]
                notes.append(f"{kind} peak: the fastest of " + ", ".join(
                    f"{m.path} {m.best / scale:.1f}" for m in paths) + f" {unit}")
        return Peaks(flops, None if read is None else read.best, self.source(),
                     self.memory_bytes, (*notes, *self.notes))

    def to_dict(self) -> dict:
        return {"format": FORMAT, "key": self.key.to_dict(), "measured_at": self.measured_at,
                "quick": self.quick, "memory_bytes": self.memory_bytes,
                "measurements": [m.to_dict() for m in self.measurements],
                "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, data: dict) -> ProbeRecord:
        return cls(MachineKey.from_dict(data["key"]), str(data["measured_at"]),
                   tuple(Measurement.from_dict(m) for m in data["measurements"]),
                   data.get("memory_bytes"), bool(data.get("quick", False)),
                   tuple(data.get("notes") or ()))


# --- the cache ---------------------------------------------------------------------------
def cache_dir() -> Path:
    return llmctl_home() / "hw"


def cache_path(key: MachineKey) -> Path:
    return cache_dir() / f"probe-{key.digest()}.json"


def save(record: ProbeRecord) -> Path:
    """Write ``record`` as its machine's cached probe (atomically: a crash leaves the old
    file or the new one, never half of one)."""
    path = cache_path(record.key)
    write_text(path, json.dumps(record.to_dict(), indent=2) + "\n")
    return path


@dataclass(frozen=True)
class CacheLookup:
    """A cache read: the record, or None with ``problem`` saying why a file that exists
    was not used (None when there simply is no file)."""

    path: Path
    record: ProbeRecord | None
    problem: str | None = None


def read_record(path: Path) -> ProbeRecord:
    """The record in ``path``; ValueError saying what is wrong with a file that exists."""
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        raise ValueError(f"written in format {found!r}, this llmctl reads format {FORMAT}")
    try:
        return ProbeRecord.from_dict(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"incomplete or malformed ({type(exc).__name__}: {exc})") from None


def load(key: MachineKey) -> CacheLookup:
    """The cached probe for ``key`` (never measures)."""
    path = cache_path(key)
    if not path.is_file():
        return CacheLookup(path, None)
    try:
        record = read_record(path)
    except (OSError, ValueError) as exc:
        return CacheLookup(path, None, str(exc))
    if record.key != key:
        return CacheLookup(path, None, f"holds the probe of another machine ({record.key.describe()})")
    return CacheLookup(path, record)


def cached_keys() -> list[MachineKey]:
    """The keys of every readable cached probe (to say which thread counts have one)."""
    keys = []
    for path in sorted(cache_dir().glob("probe-*.json")):
        try:
            keys.append(read_record(path).key)
        except (OSError, ValueError):
            continue
    return keys


def check_threads(threads: int) -> int:
    cpus = usable_cpus()
    if not 1 <= threads <= cpus:
        raise ValueError(f"threads must be between 1 and the {cpus} CPUs this process may "
                         f"run on, got {threads}")
    return threads


def current_key(threads: int | None = None) -> MachineKey:
    """This machine's key for ``threads`` (default: torch's current thread count)."""
    import torch

    return machine_key(cpu_model(), cpu_flags(),
                       torch.get_num_threads() if threads is None else threads,
                       str(torch.__version__))


def cached_peaks(threads: int | None = None) -> Peaks | None:
    """The cached probe of this machine for ``threads`` (default: torch's current count),
    None when there is none or it is unreadable. Never measures: a probe takes seconds."""
    lookup = load(current_key(threads))
    if lookup.problem:
        log.warning("ignoring the cached probe %s: %s", lookup.path, lookup.problem)
    return None if lookup.record is None else lookup.record.peaks()
