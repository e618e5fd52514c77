"""``llmctl serve ENGINE_DIR``: llmctl's serving engine over a built engine directory.

:class:`EngineDirTarget` is the :class:`~llmctl.serve.engine.target.Target` of an engine
directory: :class:`~llmctl.serve.engine.llm_engine.LLMEngine` serves it with the
scheduler, sampler, detokenizer, n-gram speculation and the HTTP API every model gets;
the forward pass is the directory's runtime through
:class:`~llmctl.engines.serve_runner.EngineRunner`. What differs:

- no torch weights are loaded: the spec (``config.json``, ``generation_config.json``)
  and the tokenizer come from the engine directory, which carries them;
- the KV "pool" is bookkeeping only: its block count is planned from
  ``kv_cache_memory`` with the runtime's cache dtype, so the block manager bounds the
  runtime's per-sequence caches (they hold the same bytes per token) without the pool
  ever being allocated;
- ``max_model_len`` is capped at the length the engine was built for, and at the
  smallest sliding window of the model (the runtimes compute full attention, which is
  the windowed attention up to there);
- prefix caching is off (a cached prefix would claim K/V the runtime never computed),
  and a draft *model* is refused (it needs the paged runner); ``ngram`` works;
- no LoRA adapters and no FLOP/byte metering (the runtime holds its own weights).

Continuous batching: the scheduler admits and retires sequences at every step as for
any model; the runtime then serialises inside one step. Decodes of all running
sequences are one batched runtime call (the torch-compile runtime splits them into
groups of its compiled ``max_batch_size``), but every prompt chunk (and every
speculative verify chunk of ``1 + k`` tokens) runs as its own call, one sequence at a
time, before the decode batch (:mod:`llmctl.engines.runtime`). A joining prompt
therefore delays that step's decodes by its own prefill time.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from llmctl.engines.engine_dir import Engine, open_engine
from llmctl.errors import ConfigError, UsageError
from llmctl.serve.engine.config import EngineConfig, make_engine_config
from llmctl.serve.engine.llm_engine import LLMEngine
from llmctl.serve.engine.target import check_max_len, tokenizer_eos_ids
from llmctl.serve.model.decoder import ModelSpec
from llmctl.serve.model.kv_cache import KVCachePlan, available_memory, plan_kv_cache

log = logging.getLogger("llmctl.serve")

# EngineConfig keys that mean nothing for an engine directory (its precision, device
# and weights are fixed at build time): accepted and ignored, with a warning if set.
IGNORED_KEYS = ("dtype", "device", "quant_backend", "tokenizer", "lm_head", "gguf_weights")


def _kv_itemsize(runtime) -> int:
    dtype = getattr(runtime, "kv_dtype", None)
    if dtype is not None:
        return int(np.dtype(dtype).itemsize)
    dtype = getattr(runtime, "dtype", None)  # torch dtype of the AOTInductor runtime
    return int(dtype.itemsize) if dtype is not None else 4


def engine_dir_settings(path: str | Path, engine_kwargs: dict[str, Any],
                        warn=log.warning) -> dict[str, Any]:
    """The engine settings an engine directory can honour, with a warning per change.

    Refuses a draft model with an error (it needs torch weights and the paged runner).
    """
    kwargs = dict(engine_kwargs)
    spec = kwargs.get("speculative")
    method = spec.get("method") if isinstance(spec, dict) else getattr(spec, "method", None)
    if method == "draft":
        raise UsageError(
            f"{path} is an engine directory: speculative decoding with a draft model is not "
            "supported there (the draft model runs on the paged torch runner)",
            "use --speculative ngram, or serve the source checkpoint with --draft-model")
    if kwargs.pop("kv_cache_dtype", "auto") != "auto":
        # not a precision to ignore: the paged cache it names is never allocated here
        raise UsageError(
            f"{path} is an engine directory: --kv-cache-dtype does not apply (its runtime "
            "keeps its own per-sequence cache, in the precision it was built with)",
            "drop --kv-cache-dtype, or serve the source checkpoint with it")
    if kwargs.get("enable_prefix_caching"):
        warn("prefix caching is off for engine directories: the runtime keeps one cache per "
             "sequence, so a shared prefix block would claim K/V it never computed")
    kwargs["enable_prefix_caching"] = False
    for key in IGNORED_KEYS:
        if kwargs.pop(key, None) not in (None, "auto", "float32"):
            warn(f"--{key.replace('_', '-')} is ignored for engine directories: the engine "
                 "was built with a fixed precision and device")
    return kwargs


class EngineDirTarget:
    """An engine directory as the engine's model: its spec and tokenizer, a KV plan for
    accounting, and ``engine.runner()`` for the forward pass."""

    serves_prompt_logprobs = True  # EngineRunner.execute_with_prompt
    serves_pooling = False  # the runtime returns logits, not hidden states
    serves_loras = False  # the runtime holds its own weights
    dtype = None  # not metered: the runtime's precision is its own

    def __init__(self, config: EngineConfig, engine: Engine) -> None:
        import torch

        if config.enable_prefix_caching:
            raise ConfigError("engine directories cannot serve with prefix caching",
                              "pass enable_prefix_caching=False (engine_dir_settings does)")
        if config.speculative is not None and config.speculative.method != "ngram":
            raise ConfigError("engine directories support only ngram speculation",
                              "use speculative={'method': 'ngram'}")
        self.engine_dir = engine
        self.device = torch.device("cpu")  # sampling runs on the host; the runtime owns its device
        self.path = engine.path
        self.spec = spec = ModelSpec.from_dir(engine.path)
        if spec.vocab_size != engine.vocab_size:
            raise ConfigError(
                f"{engine.path}: config.json says vocab_size {spec.vocab_size}, the runtime "
                f"produces {engine.vocab_size} logits", f"rebuild: {engine.manifest.build.command}")
        # the runtimes attend fully: with sliding windows, exact up to the smallest one
        limit = min(spec.max_position_embeddings, engine.max_len,
                    spec.window_free_len or engine.max_len)
        self.max_model_len = check_max_len(config, limit)
        self.tokenizer = engine.tokenizer
        self.plan: KVCachePlan = plan_kv_cache(
            num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            itemsize=_kv_itemsize(engine.runtime), block_size=config.block_size,
            budget=config.kv_cache_memory, max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len, num_blocks=config.num_kv_blocks,
            available=available_memory("cpu"))
        log.info("KV blocks below are accounting only: the %s runtime keeps per-sequence "
                 "caches", engine.manifest.target)
        self.runner = engine.runner()

    def perf_cost(self) -> tuple | None:
        """Not metered: the runtime holds its own weights and caches."""
        return None

    def fallback_eos_ids(self) -> list[int]:
        return list(self.engine_dir.eos_token_ids or ()) or tokenizer_eos_ids(self.tokenizer)

    def describe(self) -> str:
        """One line for the startup log: what actually runs."""
        e = self.engine_dir
        info = e.runtime.describe()
        return (f"serving engine directory {e.path} ({e.manifest.target}, "
                f"{e.manifest.precision}, built from {e.manifest.source.reference}) on "
                f"{e.provider}; max_model_len {self.max_model_len}, runtime max batch "
                f"{info.get('max_batch_size') or 'unbounded'}; prefix caching off")


def open_serving_engine(path: str | Path, *, warn=log.warning, runtime_options=None,
                        **engine_kwargs: Any) -> LLMEngine:
    """Check the manifest against this host, load the runtime, build the engine.

    ``engine_kwargs`` are ``LLMEngine`` settings (as for a checkpoint);
    :func:`engine_dir_settings` adjusts them first.
    """
    kwargs = engine_dir_settings(path, engine_kwargs, warn)
    config = make_engine_config(str(path), **kwargs)
    options = {"threads": config.num_threads, **(runtime_options or {})}
    engine = open_engine(path, **options)  # manifest, host compatibility, file integrity
    return LLMEngine(config, EngineDirTarget(config, engine))
