"""``Target``: what a loaded model gives the engine, whatever runs it.

:class:`~llmctl.serve.engine.llm_engine.LLMEngine` schedules, samples, detokenizes and
builds outputs for any model; what the model *is* comes from its target:

- a checkpoint on the paged torch runner,
  :class:`~llmctl.serve.engine.loader.CheckpointTarget` (the default);
- an engine directory whose runtime does the forward pass,
  :class:`~llmctl.engines.serve_engine.EngineDirTarget`.

A new kind of model implements this protocol and is handed to ``LLMEngine(config,
target)``; the engine asks nothing else of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from llmctl.perf.costs import ModelCost
    from llmctl.serve.engine.config import EngineConfig
    from llmctl.serve.model.decoder import ModelSpec
    from llmctl.serve.model.kv_cache import KVCachePlan
    from llmctl.serve.model.runner import LogitRows, PromptRows


class Runner(Protocol):
    """The forward pass over one step (:class:`~llmctl.serve.model.runner.ModelRunner`)."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of the KV blocks the scheduler forked (src, dst)."""

    def execute(self, scheduled: list) -> tuple[torch.Tensor, list[LogitRows]]:
        """Logits of the positions that sample, and which rows belong to which sequence."""

    def execute_with_prompt(self, scheduled: list
                            ) -> tuple[torch.Tensor, list[LogitRows], list[PromptRows]]:
        """As :meth:`execute`, plus every prompt position's logits of the sequences whose
        request asks for prompt log-probs and, where the target ``serves_pooling``,
        embedding requests' hidden rows (only called when one of them is scheduled)."""


class Target(Protocol):
    """A loaded model, as the engine sees it."""

    path: Path  # the model's directory (config.json, the tokenizer's files)
    spec: ModelSpec  # its architecture (vocab, layers, heads, windows, EOS ids)
    plan: KVCachePlan  # the KV cache's blocks: what the block manager hands out
    runner: Runner
    tokenizer: Any  # a transformers tokenizer
    max_model_len: int  # context length served (checked by check_max_len)
    device: torch.device  # where logits are sampled
    # the dtype the matrix products run in (the peak MFU is measured against); None:
    # unknown (a runtime that holds its own weights)
    dtype: torch.dtype | None
    serves_prompt_logprobs: bool  # the runner's execute_with_prompt may be used
    serves_pooling: bool  # execute_with_prompt returns embeddings' PooledRows
    serves_loras: bool  # LoRA adapters can be applied (the paged torch runner)

    def perf_cost(self) -> tuple[ModelCost, float] | None:
        """The cost model steps are metered with, and the weight bytes one step reads;
        None when not metered (the server then exports no utilization)."""

    def fallback_eos_ids(self) -> list[int]:
        """EOS ids when the model's config names none."""


def tokenizer_eos_ids(tokenizer) -> list[int]:
    """The tokenizer's EOS id, as a list (empty when it has none)."""
    eos = tokenizer.eos_token_id
    return [eos] if eos is not None else []


def check_max_len(config: EngineConfig, limit: int) -> int:
    """The context length served: ``config.max_model_len`` capped at what the model
    supports; without chunked prefill a whole prompt must fit in one step."""
    from llmctl.errors import ConfigError

    max_len = min(config.max_model_len or limit, limit)
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_len:
        raise ConfigError(
            f"without chunked prefill a prompt of up to max_model_len={max_len} tokens "
            f"must fit in one step of max_num_batched_tokens="
            f"{config.max_num_batched_tokens}",
            "enable chunked prefill, or lower max_model_len / raise max_num_batched_tokens")
    return max_len
