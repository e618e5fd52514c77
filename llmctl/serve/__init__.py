"""The built-in inference engine: paged KV cache, prefix caching, continuous batching,
chunked prefill, preemption, speculative decoding, low-bit weights.

Laid out by concept, one sub-package each, importing only those listed before it
(``tests/test_import_graph.py:SERVE_ORDER``)::

    kernels   the C++ CPU kernels (csrc/) and their loader
    lora      LoRA adapters and one step's LoRA work
    layers    attention, RoPE, plain and low-bit linears, fused decode layers, KV codecs
    core      requests and sequences, sampling parameters, blocks, policies, the scheduler
    model     the forward on the paged cache, its weights, KV cache sizing, the runner
    sample    logits -> tokens, speculative decoding, grammars
    engine    the engine front (offline, in-process, async) and its Target protocol,
              outputs, stats, model sources, the EngineClient protocol
    proc      engine processes, replicas and their routing
    openai    the OpenAI API without HTTP: bodies, prompts, sampling, completions, chat,
              tool calls, response assembly (the server and ``llmctl batch`` share it)
    api       HTTP only: the FastAPI app, routers, streaming, limits, tenancy/, tracing
    handoff   hand a model to vLLM or TensorRT-LLM instead
    launch    ``llmctl serve`` settings -> a running server
    batch     ``llmctl batch``: Batch API files on the engine, without HTTP

``LLM``, ``LLMEngine``, ``SamplingParams`` and ``EngineConfig`` are exported lazily, so
importing this package does not import torch.
"""

from __future__ import annotations

_EXPORTS = {
    "LLM": "llmctl.serve.engine.llm",
    "LLMEngine": "llmctl.serve.engine.llm_engine",
    "SamplingParams": "llmctl.serve.core.sampling_params",
    "EngineConfig": "llmctl.serve.engine.config",
    "RequestOutput": "llmctl.serve.engine.outputs",
    "CompletionOutput": "llmctl.serve.engine.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'llmctl.serve' has no attribute {name!r}")
