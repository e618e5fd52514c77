"""Estimate a run's peak memory before starting, and refuse early if it cannot fit.

The pipeline holds, at its peak: one decoder layer in float32 (plus its quantized
copy), the calibration activations (residual stream, attention output and MLP
activation for every calibration token), the Hessians of one layer's inputs, one
chunk's temporaries and the output shard being filled. Everything else stays on disk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from llmctl.errors import ResourceError
from llmctl.models.spec import ModelArch

GIB = 1 << 30


def available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return None


def current_rss() -> int:
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


@dataclass
class MemoryEstimate:
    parts: dict[str, int] = field(default_factory=dict)
    available: int | None = None
    baseline: int = 0  # what the process already holds

    @property
    def needed(self) -> int:
        return sum(self.parts.values())

    @property
    def peak(self) -> int:
        return self.baseline + self.needed

    def to_dict(self) -> dict:
        return {"parts": self.parts, "needed_bytes": self.needed, "baseline_bytes": self.baseline,
                "peak_bytes": self.peak, "available_bytes": self.available}


def estimate(arch: ModelArch, *, samples: int, seq_len: int, compute_bytes: int,
             chunk_tokens: int, layer_params: int, hessian_dims: list[int],
             max_rows: int, smoothing: bool) -> MemoryEstimate:
    hidden, inter = arch.hidden_size, arch.intermediate_size
    heads, head_dim, vocab = arch.num_heads, arch.head_dim, arch.vocab_size
    tokens = samples * seq_len
    chunk_seqs = max(1, chunk_tokens // seq_len)
    parts = {
        "layer weights": layer_params * (4 + compute_bytes) * (2 if smoothing else 1),
        # residual stream + one buffer shared by attention output and MLP activation
        "calibration activations": tokens * (hidden + max(inter, heads * head_dim)) * compute_bytes,
        "hessians": sum(d * d * 4 for d in hessian_dims) + (max(hessian_dims, default=0) ** 2) * 12,
        "quantizer working set": max_rows * max(hessian_dims + [hidden]) * 4 * 4,
        "chunk temporaries": chunk_seqs * seq_len * (3 * inter + 6 * hidden) * 4
        + chunk_seqs * heads * seq_len * seq_len * 4,
        "embedding lookup": vocab * hidden * 4,
    }
    return MemoryEstimate(parts, available_bytes(), current_rss())


def check(est: MemoryEstimate, *, headroom: float = 0.9) -> None:
    if est.available is None or est.needed <= est.available * headroom:
        return
    raise ResourceError(
        f"quantizing needs about {est.needed / GIB:.1f} GiB more memory; "
        f"{est.available / GIB:.1f} GiB is available "
        f"(calibration activations {est.parts['calibration activations'] / GIB:.1f} GiB)",
        "use fewer --samples or a shorter --seq-len, or free memory")
