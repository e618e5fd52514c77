"""Loading a checkpoint for the engine: its weights, KV cache and paged runner.

:class:`LoadedModel` is one model ready to run (the target, or a speculative draft
model); :class:`CheckpointTarget` is the :class:`~llmctl.serve.engine.target.Target`
of a checkpoint (what ``LLMEngine`` loads when it is given no target): the model plus
its tokenizer, context length, cost model and EOS fallback.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from llmctl.errors import ConfigError
from llmctl.serve.engine.config import EngineConfig
from llmctl.serve.engine.target import check_max_len, tokenizer_eos_ids
from llmctl.serve.layers.kv_quant import kv_format
from llmctl.serve.lora.adapter import LoRARegistry
from llmctl.serve.model.decoder import LlamaModel, ModelSpec
from llmctl.serve.model.kv_cache import (
    KVCachePlan,
    allocate_kv_cache,
    allocate_kv_scales,
    available_memory,
    plan_kv_cache,
)
from llmctl.serve.model.runner import ModelRunner
from llmctl.utils.dtypes import FLOAT_DTYPES, torch_dtype

log = logging.getLogger("llmctl.serve")


class LoadedModel:
    """A model with its KV cache and runner (the target, or a draft model)."""

    def __init__(self, resolved, config: EngineConfig, device: torch.device, max_len: int,
                 num_blocks: int | None = None, with_lora: bool = False,
                 tokenizer=None, spec: ModelSpec | None = None) -> None:
        from llmctl.serve.model.weights import load_model

        path = resolved.path
        self.path: Path = path
        self.spec = spec or ModelSpec.from_dir(path)
        name = config.dtype if config.dtype != "auto" else self.spec.torch_dtype
        dtype = torch_dtype(name) if name in FLOAT_DTYPES else torch.float32
        reader = None
        if gguf_native(resolved, config):
            from llmctl.serve.model.gguf_weights import GGUFWeights

            reader = GGUFWeights(resolved.origin)
        self.model: LlamaModel = load_model(path, dtype=dtype, device=device,
                                            backend=config.quant_backend, max_len=max_len,
                                            spec=self.spec, reader=reader,
                                            lm_head=config.lm_head,
                                            bf16_gemm=config.bf16_gemm)
        fmt = kv_format(kv_cache_dtype(config.kv_cache_dtype, path), dtype)
        spec = self.spec
        self.plan: KVCachePlan = plan_kv_cache(
            num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            itemsize=torch.tensor([], dtype=fmt.storage).element_size(),
            block_size=config.block_size, budget=config.kv_cache_memory,
            max_num_seqs=config.max_num_seqs, max_model_len=max_len,
            num_blocks=num_blocks or config.num_kv_blocks,
            available=available_memory(device.type), scale_bytes=fmt.scale_bytes,
            dtype=fmt.describe())
        self.kv_cache = allocate_kv_cache(self.plan, num_layers=spec.num_layers,
                                          num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                                          dtype=fmt.storage, device=device)
        # the scales of an 8-bit cache (kv_quant), None for a float cache; fp8's are
        # static, from the checkpoint or calibrated on ``tokenizer``'s text (kv_scales)
        self.kv_scales = None
        self.kv_scales_source = None
        if fmt.static_scales:
            from llmctl.serve.model.kv_scales import fp8_kv_scales

            self.kv_scales, self.kv_scales_source = fp8_kv_scales(
                path, self.model, tokenizer, config.kv_scale_granularity, max_len)
        elif fmt.quantized:
            self.kv_scales = allocate_kv_scales(self.plan, num_layers=spec.num_layers,
                                                num_kv_heads=spec.num_kv_heads, device=device)
        self.runner = ModelRunner(self.model, self.kv_cache, config.block_size, with_lora,
                                  kv_scales=self.kv_scales)


class CheckpointTarget(LoadedModel):
    """A checkpoint (anything :func:`~llmctl.models.resolve.resolve_model` takes): torch
    weights on the paged runner, with LoRA adapters and prompt log-probs."""

    serves_prompt_logprobs = True
    serves_pooling = True
    serves_loras = True

    def __init__(self, config: EngineConfig) -> None:
        from llmctl.models.loading import load_tokenizer
        from llmctl.models.resolve import resolve_model

        self.device = resolve_device(config)
        resolved = resolve_model(config.model)
        spec = ModelSpec.from_dir(resolved.path)
        self.max_model_len = check_max_len(config, spec.max_position_embeddings)
        self.tokenizer = load_tokenizer(resolve_model(config.tokenizer).path
                                        if config.tokenizer else resolved.path)
        super().__init__(resolved, config, self.device, self.max_model_len, with_lora=True,
                         tokenizer=self.tokenizer, spec=spec)

    @property
    def dtype(self) -> torch.dtype:
        # int4/int8 weights are widened to the activation dtype: theirs run in it too
        return self.model.dtype

    def perf_cost(self) -> tuple | None:
        """FLOPs from the architecture in config.json, bytes from the weights as loaded
        (:attr:`LlamaModel.bytes_read_per_step`) and the KV cache's dtype. None for an
        architecture the cost model does not describe."""
        from llmctl.perf.costs import ArchSpec, ModelCost

        try:
            config = json.loads((Path(self.path) / "config.json").read_text())
            spec = self.spec
            # per K/V element read, an 8-bit cache's scales included
            kv_bytes = self.plan.bytes_per_block / (
                spec.num_layers * 2 * self.plan.block_size * spec.num_kv_heads
                * spec.head_dim)
            cost = ModelCost(ArchSpec.from_config(config), kv_bytes=kv_bytes)
        except (OSError, ValueError, ConfigError) as exc:
            log.info("no FLOP/byte accounting for this model: %s", exc)
            return None
        return cost, float(self.model.bytes_read_per_step)

    def fallback_eos_ids(self) -> list[int]:
        return tokenizer_eos_ids(self.tokenizer)


def resolve_device(config: EngineConfig) -> torch.device:
    """``auto`` is the GPU when there is one."""
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def load_draft(config: EngineConfig, device: torch.device, max_len: int, num_blocks: int,
               tokenizer, vocab_size: int) -> LoadedModel:
    """The speculative draft model (``config.speculative.draft_model``), with as many KV
    blocks as the target's; its vocabulary must be the target's."""
    from llmctl.models.resolve import resolve_model

    draft = LoadedModel(resolve_model(config.speculative.draft_model), config, device, max_len,
                        num_blocks=num_blocks, tokenizer=tokenizer)
    if draft.spec.vocab_size != vocab_size:
        raise ConfigError(
            f"the draft model's vocabulary ({draft.spec.vocab_size}) differs from the "
            f"target's ({vocab_size})",
            "use a draft model with the same tokenizer as the target")
    return draft


def load_loras(target, config: EngineConfig) -> LoRARegistry | None:
    """The LoRA adapters served (``config.loras`` loaded now); None when the target cannot
    apply any (an engine directory's runtime holds its own weights)."""
    if not target.serves_loras:
        if config.loras:
            raise ConfigError("LoRA adapters run on the paged torch runner only; this "
                              "engine directory cannot serve them",
                              "serve the source checkpoint with --lora")
        return None
    # float32 adapters whatever the model's dtype (llmctl.serve.lora.batch)
    registry = LoRARegistry(target.spec, max_rank=config.max_lora_rank,
                            dtype=torch.float32, device=target.device)
    for name, path in config.loras.items():
        adapter = registry.load(name, path)
        log.info("LoRA adapter %r: rank %d, scale %g, %.1f MiB (%s)", name, adapter.rank,
                 adapter.scaling, adapter.nbytes / 2**20, path)
    return registry


def kv_cache_dtype(asked: str, path: Path) -> str:
    """``auto`` is fp8 for a checkpoint whose ``kv_cache_scheme`` asks for it (its author
    calibrated the scales; vLLM's ``auto`` does the same), else the model's dtype. An
    explicit choice wins."""
    from llmctl.models.resolve import kv_cache_scheme

    scheme = kv_cache_scheme(path) if asked == "auto" else None
    if scheme is not None and (scheme.get("type"), scheme.get("num_bits")) == ("float", 8):
        log.info("KV cache: fp8, as the checkpoint's kv_cache_scheme asks (--kv-cache-dtype "
                 "bfloat16 or float32 keeps a float cache)")
        return "fp8"
    return asked


def gguf_native(resolved, config: EngineConfig) -> bool:
    """Whether a GGUF-derived model keeps its quantized tensors (see EngineConfig)."""
    if resolved.origin is None or config.quant_backend != "kernel":
        return False
    if config.gguf_weights == "auto":
        return resolved.source == "gguf"
    return config.gguf_weights == "quantized"
