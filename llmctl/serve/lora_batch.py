"""One step's LoRA work: the step's rows grouped by adapter, one small matmul pair per
adapter per fused linear (no merge into the base weights, no padding to a common rank).

For the rows ``R_a`` of adapter ``a`` and a fused linear with input ``x`` and output
``y = W x`` (already computed for every row by the base path)::

    y[R_a] += (x[R_a] @ A_a^T) @ B_a^T          # s_a folded into B_a (lora_adapter)

so a row costs ``in * r + r * out`` extra multiply-adds for its own adapter only, and
base rows cost nothing. A masked form over ``max_loras x rank`` columns for every row
(a previous attempt) paid every adapter for every row: ~0.42x base throughput at 4
adapters. The runner orders a step's sequences by adapter inside each attention group,
so an adapter's rows are usually one contiguous range (a view: no gather, an in-place
``addmm_``); otherwise they are gathered and scattered back with ``index_add_``
(S-LoRA and Punica's kernels do the same gather/segment work on GPUs).

A step in which no row has an adapter builds no :class:`LoRABatch` at all: the model
runs exactly as without LoRA (fused native decode layers included).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from llmctl.serve.lora_adapter import LoRAAdapter


class LoRABatch:
    """``segments``: (adapter, rows) with rows a slice or a long index tensor."""

    __slots__ = ("segments",)

    def __init__(self, segments: list[tuple[LoRAAdapter, slice | torch.Tensor]]) -> None:
        self.segments = segments

    @classmethod
    def from_runs(cls, runs: list[tuple[LoRAAdapter | None, int, int]],
                  device: torch.device) -> LoRABatch | None:
        """From (adapter or None, first row, end row) per sequence, in row order; None
        when no row has an adapter."""
        rows: dict[int, list[tuple[int, int]]] = {}
        adapters: dict[int, LoRAAdapter] = {}
        for adapter, start, end in runs:
            if adapter is None or end <= start:
                continue
            adapters[adapter.lora_id] = adapter
            spans = rows.setdefault(adapter.lora_id, [])
            if spans and spans[-1][1] == start:
                spans[-1] = (spans[-1][0], end)  # adjoining: extend the range
            else:
                spans.append((start, end))
        if not rows:
            return None
        segments: list[tuple[LoRAAdapter, slice | torch.Tensor]] = []
        for lora_id, spans in rows.items():
            if len(spans) == 1:
                where: slice | torch.Tensor = slice(*spans[0])
            else:
                where = torch.cat([torch.arange(s, e) for s, e in spans]).to(device)
            segments.append((adapters[lora_id], where))
        return cls(segments)

    def apply(self, layer: int, target: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y += LoRA(x)`` on each adapter's rows, for fused linear ``target`` of
        ``layer`` (``y`` is that linear's output for ``x``, updated in place)."""
        for adapter, rows in self.segments:
            pair = adapter.layers[layer].get(target)
            if pair is None:
                continue
            a_t, b_t = pair
            if isinstance(rows, slice):
                y[rows].addmm_(x[rows] @ a_t, b_t)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a_t) @ b_t)
