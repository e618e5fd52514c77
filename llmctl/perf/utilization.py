"""Achieved FLOP/s and bytes/s per phase, and MFU/MBU against the hardware's peaks.

Formulas (:mod:`llmctl.perf.costs` computes FLOPs and bytes from the architecture and the
weights as stored):

- MFU = FLOPs computed / busy seconds / peak FLOP/s (of the dtype the products run in);
- MBU = bytes read / busy seconds / peak read bandwidth.

Two sources of FLOPs, bytes and seconds, best first:

1. **the engine's own counters** (``llmctl serve``'s ``/metrics``:
   ``llmctl:{prefill,decode}_{flops,bytes,busy_seconds}_total``). Each step's FLOPs and
   bytes come from the tokens it actually computed (prefix-cache hits are not computed)
   and the contexts it actually read; a step that computes any prompt token counts as
   prefill, a step of generated tokens only as decode; seconds are the steps' wall time.
2. **the client's records** (any server). Per request i with prompt p_i, output o_i:
   prefill FLOPs = prefill_flops(p_i) (prefix hits unknown: counted as computed, so
   prefill MFU is an upper bound when a cache hit), decode FLOPs = sum over its generated
   tokens of flops_per_token(context). Busy seconds of a phase = the time at least one
   request was in it (union of [send, first token] and of [first token, end]); requests
   in both phases at once overlap, so each phase's utilization is a lower bound. Decode
   bytes = decode steps x weights read per step + the KV each generated token reads, with
   decode steps = decode busy seconds / median inter-token latency.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from llmctl.perf.peaks import Peaks

PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class PhaseLoad:
    """What a phase computed and read, and for how long."""

    flops: float
    bytes: float
    seconds: float

    def __add__(self, other: PhaseLoad) -> PhaseLoad:
        return PhaseLoad(self.flops + other.flops, self.bytes + other.bytes,
                         self.seconds + other.seconds)


@dataclass(frozen=True)
class PhaseUse:
    """One phase's achieved rates and their share of the peaks."""

    phase: str
    load: PhaseLoad
    flops_per_s: float | None
    bytes_per_s: float | None
    mfu: float | None  # None: no peak for this dtype, or nothing ran
    mbu: float | None

    def to_dict(self) -> dict:
        return {"flops": self.load.flops, "bytes": self.load.bytes,
                "busy_seconds": self.load.seconds, "achieved_flops_per_s": self.flops_per_s,
                "achieved_bytes_per_s": self.bytes_per_s, "mfu": self.mfu, "mbu": self.mbu}


def use(phase: str, load: PhaseLoad, peaks: Peaks | None, dtype: str) -> PhaseUse:
    """MFU/MBU of ``load`` against ``peaks`` (products in ``dtype``)."""
    if load.seconds <= 0:
        return PhaseUse(phase, load, None, None, None, None)
    fps, bps = load.flops / load.seconds, load.bytes / load.seconds
    peak_f = peaks.flops_for(dtype) if peaks is not None else None
    peak_b = peaks.bandwidth if peaks is not None else None
    return PhaseUse(phase, load, fps, bps, fps / peak_f if peak_f else None,
                    bps / peak_b if peak_b else None)


# --- source 1: the engine's counters -------------------------------------------------------

# ``llmctl:{phase}_{field}_total`` on llmctl serve's /metrics
COUNTER_FIELDS = {"flops": "FLOPs computed", "bytes": "Bytes read (weights + KV)",
                  "busy_seconds": "Wall seconds"}


def counter_names() -> dict[str, str]:
    """Server-summary key -> metric base name, for the bench scraper's counter table."""
    return {f"{p}_{f}": f"{p}_{f}" for p in PHASES for f in COUNTER_FIELDS}


def from_counters(deltas: Mapping[str, float | None]) -> dict[str, PhaseLoad] | None:
    """Per-phase loads from the counters' changes over a run (``{"prefill_flops": ...}``),
    None when the server does not export them."""
    loads = {}
    for phase in PHASES:
        values = [deltas.get(f"{phase}_{f}") for f in COUNTER_FIELDS]
        if any(v is None for v in values):
            return None
        loads[phase] = PhaseLoad(*values)
    return loads


# --- source 2: the client's records ---------------------------------------------------------

@dataclass(frozen=True)
class Timed:
    """The part of a request record this module reads (seconds since the run started)."""

    prompt_len: int
    output_tokens: int
    start: float
    ttft: float
    latency: float
    itl: Sequence[float] = ()


def _union(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def from_requests(requests: Sequence[Timed], cost) -> dict[str, PhaseLoad]:
    """Per-phase loads estimated from client timings (see the module doc); ``cost`` is a
    :class:`llmctl.perf.costs.ModelCost`."""
    prefill = PhaseLoad(sum(cost.prefill_flops(r.prompt_len) for r in requests),
                        sum(cost.prefill_bytes(r.prompt_len) for r in requests),
                        _union((r.start, r.start + r.ttft) for r in requests))
    decode_seconds = _union((r.start + r.ttft, r.start + r.latency)
                            for r in requests if r.output_tokens > 1)
    # each generated token after the first is one decode row at context p + j
    contexts = [r.prompt_len + j for r in requests for j in range(1, r.output_tokens)]
    gaps = [g for r in requests for g in r.itl]
    steps = decode_seconds / statistics.median(gaps) if gaps else 0.0
    flops = sum(cost.flops_per_token(c) for c in contexts)
    kv = sum(cost.sequence_kv_bytes(c) for c in contexts)  # a window's share in windowed layers
    decode = PhaseLoad(flops, steps * cost.weight_bytes_read_per_step + kv, decode_seconds)
    return {"prefill": prefill, "decode": decode}


def report(loads: Mapping[str, PhaseLoad], peaks: Peaks | None, dtype: str,
           source: str) -> dict:
    """The report's ``utilization`` section: per phase and overall, with the formulas'
    source and the peaks' source."""
    phases = {p: use(p, loads[p], peaks, dtype).to_dict() for p in PHASES if p in loads}
    return {"source": source, "dtype": dtype,
            "peaks": peaks.to_dict() if peaks is not None else None,
            "peak_source": peaks.source if peaks is not None else "unknown hardware: "
            "run `llmctl hw probe` (CPU) or pass --hardware/--peak-flops/--peak-bandwidth",
            "formulas": {"mfu": "FLOPs / busy seconds / peak FLOP/s",
                         "mbu": "bytes read / busy seconds / peak read bandwidth",
                         "flops_per_token": "2 x matmul parameters + 4 x layers x heads x "
                                            "head_dim x context",
                         "decode_bytes_per_step": "weights as stored (tied embedding once) "
                                                  "+ context x KV bytes per token"},
            "phases": phases}
