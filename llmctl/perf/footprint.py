"""A model's size from its config.json alone: what ``llmctl info`` shows next to the
checkpoint's own numbers.

- parameters: every stored parameter of the architecture (:class:`~llmctl.perf.costs.ModelCost`:
  linears, lm_head, the embedding once when tied, norm vectors and biases);
- weight bytes in the checkpoint's format (its quantization_config, else 16-bit);
- KV bytes per token (every layer holds the token) and of one sequence at the model's
  context, where a sliding-window layer holds at most its window::

      kv(L) = sum_l min(L, W_l) * 2 * kv_heads * head_dim * bytes
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from llmctl.perf.arch import ArchSpec
from llmctl.perf.costs import ModelCost
from llmctl.perf.plan import KV_DTYPES
from llmctl.perf.weight_format import WeightFormat


@dataclass(frozen=True)
class Footprint:
    parameters: int
    weight_format: str
    weight_bytes: float
    kv_dtype: str
    kv_bytes_per_token: float  # one token in every layer
    context: int  # the model's context (max_position_embeddings), or the one asked for
    kv_bytes_context: float  # one sequence of ``context`` tokens, windows counted
    sliding_layers: int  # layers that hold at most their window

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def footprint(config: dict[str, Any], context: int | None = None,
              kv_dtype: str = "bf16") -> Footprint:
    """The :class:`Footprint` of a config.json (``context`` default: the model's, else
    4096)."""
    arch = ArchSpec.from_config(config)
    fmt = WeightFormat.from_config(config)
    cost = ModelCost(arch, fmt, KV_DTYPES[kv_dtype])
    context = context or arch.max_position_embeddings or 4096
    return Footprint(
        parameters=cost.total_params, weight_format=fmt.name, weight_bytes=cost.weight_bytes,
        kv_dtype=kv_dtype, kv_bytes_per_token=cost.kv_bytes_per_token, context=context,
        kv_bytes_context=cost.sequence_kv_bytes(context),
        sliding_layers=sum(w is not None for w in arch.layer_windows))
