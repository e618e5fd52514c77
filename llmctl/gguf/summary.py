"""What a GGUF file holds, as data: size, bits per weight, tensor types, metadata.

Used by ``llmctl info FILE.gguf`` and by the export summary. Reads any GGUF the
``gguf`` package can parse (any architecture, any tensor type): only the header
and tensor table, never the weights.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from llmctl.models.gguf_reader import read_metadata


def type_counts(tensors: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in tensors:
        counts[t["type"]] = counts.get(t["type"], 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def bits_per_weight(tensors: list[dict[str, Any]]) -> float:
    """8 x tensor bytes / weights, as llama-quantize reports "BPW" (header excluded)."""
    n = sum(math.prod(t["shape"]) for t in tensors)
    return 8 * sum(t["n_bytes"] for t in tensors) / max(n, 1)


def summarize_gguf(path: Path) -> dict[str, Any]:
    path = Path(path)
    meta, entries = read_metadata(path)
    tensors = [{**asdict(t), "shape": list(t.shape)} for t in entries]
    return {
        "path": str(path),
        "size": path.stat().st_size,
        "n_parameters": sum(math.prod(t["shape"]) for t in tensors),
        "tensor_bytes": sum(t["n_bytes"] for t in tensors),
        "bits_per_weight": bits_per_weight(tensors),
        "types": type_counts(tensors),
        "metadata": meta,
        "tensors": tensors,
    }
