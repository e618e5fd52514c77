"""The peak rates a utilization is measured against, and where they came from.

MFU is achieved FLOP/s over :attr:`Peaks.flops` for the dtype the matrix products run
in; MBU is achieved bytes/s over :attr:`Peaks.bandwidth` (memory reads). A peak always
carries its ``source``, shown beside every utilization: a CPU's comes from
``llmctl hw probe`` (:mod:`llmctl.hw.probe`, measured and cached per machine), a GPU's
from the datasheet table (:mod:`llmctl.perf.devices`), or from the user's overrides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The dtypes peaks are keyed by: what the matrix products run in.
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8", "int4")


@dataclass(frozen=True)
class Peaks:
    """Peak matrix-product rates per dtype (FLOP/s; int8/int4 in OP/s) and memory read
    bandwidth (bytes/s) of one device, or of the threads used on a CPU."""

    flops: dict[str, float]
    bandwidth: float | None
    source: str  # e.g. "probe: AMD EPYC 9B14, 2 threads (2026-11-24)", "table: h100-sxm"
    memory_bytes: int | None = None  # device memory (GPU) or RAM (CPU), when known
    notes: tuple[str, ...] = field(default_factory=tuple)  # what was measured, caveats

    def __post_init__(self) -> None:
        unknown = set(self.flops) - set(DTYPES)
        if unknown:
            raise ValueError(f"unknown peak dtype(s) {sorted(unknown)}; known: {', '.join(DTYPES)}")

    def flops_for(self, dtype: str) -> float | None:
        """The peak for products in ``dtype`` ("bf16", "fp32", ...), None when unknown."""
        return self.flops.get(dtype)

    def with_overrides(self, *, flops: float | None = None, dtype: str = "bf16",
                       bandwidth: float | None = None) -> Peaks:
        """These peaks with ``--peak-flops`` (for ``dtype``) / ``--peak-bandwidth``
        replacing the measured or tabled values; the source says so."""
        if flops is None and bandwidth is None:
            return self
        new_flops = dict(self.flops)
        parts = [self.source]
        if flops is not None:
            new_flops[dtype] = flops
            parts.append(f"override: {dtype} {flops:.3g} FLOP/s")
        if bandwidth is not None:
            parts.append(f"override: {bandwidth:.3g} B/s")
        return Peaks(new_flops, bandwidth if bandwidth is not None else self.bandwidth,
                     "; ".join(parts), self.memory_bytes, self.notes)

    def to_dict(self) -> dict:
        return {"flops": dict(self.flops), "bandwidth": self.bandwidth, "source": self.source,
                "memory_bytes": self.memory_bytes, "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, data: dict) -> Peaks:
        return cls({k: float(v) for k, v in data["flops"].items()},
                   None if data.get("bandwidth") is None else float(data["bandwidth"]),
                   str(data["source"]), data.get("memory_bytes"),
                   tuple(data.get("notes") or ()))
