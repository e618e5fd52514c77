"""Weight bytes one batch-1 decode step reads, for the bandwidth bound of decode.

A decode step at batch 1 reads every matmul weight once, but only one row of the
embedding table (the lookup of the one new token). The lm_head matmul reads its whole
weight; with tied embeddings that weight *is* the embedding table (a packed copy of it
in llmctl's bf16 engine), read once per token by the matmul, and the lookup adds one
row. Counting the resident tensors instead (embedding table + packed lm_head copy) puts
the tied table in twice: for SmolLM2-135M in bf16 that is 57 MB of 326 MB, so the old
bandwidth fraction was ~20% too high.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class WeightRead:
    """One weight tensor as decode uses it: ``lookup`` tables give one row per token."""

    name: str
    nbytes: int
    rows: int = 1
    lookup: bool = False


def bytes_read_per_token(weights: Iterable[WeightRead]) -> int:
    """Bytes of weights a batch-1 decode step reads: matmul weights whole, lookups one row."""
    total = 0
    for w in weights:
        if w.lookup:
            if w.rows <= 0 or w.nbytes % w.rows:
                raise ValueError(f"{w.name}: {w.nbytes} bytes do not split into {w.rows} rows")
            total += w.nbytes // w.rows
        else:
            total += w.nbytes
    return total


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def _decode_path_bytes(layer) -> int:
    """Bytes one call of an llmctl linear reads at batch 1 (its kernel path)."""
    kind = getattr(layer, "kind", None)
    if hasattr(layer, "scales_zeros"):  # torch's int4 kernel reads its packed codes and
        # scales, not the nibble copy kept for large batches
        return sum(_tensor_bytes(t) for t in (layer.packed, layer.scales_zeros, layer.bias)
                   if t is not None)
    if kind == "concat":
        return sum(_decode_path_bytes(p) for p in layer.parts)
    if hasattr(layer, "active_nbytes"):  # a mixture of experts: the router, the shared
        # expert and k of its E experts, at their bytes as held (low-bit codes or float)
        return layer.active_nbytes
    return layer.nbytes


def llmctl_model_reads(model) -> list[WeightRead]:
    """The :class:`WeightRead` list of an llmctl ``LlamaModel`` (plumbing for the above)."""
    import torch

    from llmctl.serve.model.decoder import Layer

    reads = [WeightRead("embed", _tensor_bytes(model.embed), rows=model.embed.shape[0],
                        lookup=True),
             WeightRead("norm", _tensor_bytes(model.norm))]
    for i, layer in enumerate(model.layers):
        for name in Layer.__slots__:
            part = getattr(layer, name)
            if isinstance(part, torch.Tensor):
                reads.append(WeightRead(f"layers.{i}.{name}", _tensor_bytes(part)))
            elif part is not None:
                reads.append(WeightRead(f"layers.{i}.{name}", _decode_path_bytes(part)))
    # tied or not, the lm_head matmul reads its whole weight once (a tied one is the
    # embedding table itself, or a packed copy of it: the same number of bytes)
    reads.append(WeightRead("lm_head", _decode_path_bytes(model.lm_head)))
    return reads
