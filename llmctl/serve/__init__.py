"""The built-in inference engine: paged KV cache, prefix caching, continuous batching,
chunked prefill, preemption, speculative decoding, low-bit weights.

Imports flow one way::

    sampling_params -> sequence -> block_manager, policy -> scheduler
    policy (the ordering tables) -> config
    rope, attention, quant_linear -> model -> weights -> model_runner
    sampler, detokenizer, rejection_sampler, spec_decode, admission -> llm_engine -> llm

``LLM``, ``LLMEngine``, ``SamplingParams`` and ``EngineConfig`` are exported lazily, so
importing this package does not import torch.
"""

from __future__ import annotations

_EXPORTS = {
    "LLM": "llmctl.serve.llm",
    "LLMEngine": "llmctl.serve.llm_engine",
    "SamplingParams": "llmctl.serve.sampling_params",
    "EngineConfig": "llmctl.serve.config",
    "RequestOutput": "llmctl.serve.outputs",
    "CompletionOutput": "llmctl.serve.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'llmctl.serve' has no attribute {name!r}")
