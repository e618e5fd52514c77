"""Engine configuration: one typed object that refuses unknown keys.

``EngineConfig(**kwargs)`` is what ``LLM(model, **kwargs)``, ``LLMEngine`` and the CLI
flags all build; a misspelt key fails with the key's name and the allowed ones.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmctl.errors import ConfigError
from llmctl.serve.core.policy import DEFAULT_CLASS, DEFAULT_CLASSES
from llmctl.utils.dtypes import DTYPE_ALIASES
from llmctl.utils.sizes import parse_memory

# --dtype and --kv-cache-dtype spellings: the float aliases, and vLLM's name for fp8 KV.
_DTYPE_ALIASES = {**DTYPE_ALIASES, "fp8_e4m3": "fp8"}


class SpeculativeConfig(BaseModel):
    """Speculative decoding: who proposes draft tokens and how many per step."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft"] = "ngram"
    num_speculative_tokens: int = Field(4, ge=1, le=16)
    # n-gram prompt lookup: match the last n tokens (n from max down to min) earlier in
    # the sequence and propose what followed them there.
    ngram_min: int = Field(1, ge=1)
    ngram_max: int = Field(4, ge=1)
    # draft-model proposer: a smaller checkpoint with the same tokenizer.
    draft_model: str | None = None

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError("ngram_min must not exceed ngram_max")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("method 'draft' needs draft_model (a checkpoint path or alias)")
        return self


class EngineConfig(BaseModel):
    """Everything that shapes one engine instance."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    tokenizer: str | None = None
    # "auto": the checkpoint's torch_dtype when it is a float type, else float32
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    # "auto" = the model dtype, or fp8 for a checkpoint with an FP8 kv_cache_scheme (as
    # vLLM's auto; engine.loader.kv_cache_dtype); bfloat16 halves the cache's memory and bandwidth; int8
    # stores codes with a scale per token and KV head (llmctl.serve.layers.kv_quant): ~1.9x the
    # blocks of bfloat16 in the same memory; fp8 (E4M3) codes with static scales per
    # layer and KV head (the checkpoint's kv_cache_scheme, or calibrated): 2x.
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "int8", "fp8"] = "auto"
    # fp8 scales calibrated at start (a checkpoint without kv_cache_scheme): one per KV
    # head, or one per layer (llmctl.serve.model.kv_scales)
    kv_scale_granularity: Literal["head", "layer"] = "head"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    block_size: int = Field(16, ge=1, le=1024)
    # A byte budget ("512MiB") or a fraction (0.3) of the memory free after loading.
    kv_cache_memory: str | float = "0.25"
    # Exact number of KV blocks: overrides kv_cache_memory (tests use it to force preemption).
    num_kv_blocks: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # Quantized checkpoints: "kernel" runs int4/int8 weights through torch's low-bit CPU
    # kernels; "dequantize" expands them to float at load (the reference path).
    quant_backend: Literal["kernel", "dequantize"] = "kernel"
    # A GGUF's Q4_0/Q4_1/Q8_0 tensors: "quantized" runs them as they are on the low-bit
    # kernel, "float" dequantizes at load; "auto" = quantized for a .gguf path, float for
    # an embedded alias (which names the float checkpoint the benchmarks compare).
    gguf_weights: Literal["auto", "quantized", "float"] = "auto"
    # "int8": the output projection on int8 codes, a scale per 32 inputs (CPU);
    # "auto": as the checkpoint has it.
    lm_head: Literal["auto", "int8"] = "auto"
    # bfloat16 dense layers on the CPU (llmctl.serve.model.weights.bf16_gemm_plan): "own" =
    # csrc/gemm_bf16.cpp at every batch size, "onednn" = oneDNN's packed GEMM, "auto" =
    # own on CPUs without AMX; with AMX oneDNN, plus own (on the tile unit from 8 rows)
    # for decode batches of up to 32 rows (PackedLinear.both_rows) when that second copy
    # of the weights takes at most 1/8 of the machine's memory.
    bf16_gemm: Literal["auto", "own", "onednn"] = "auto"
    speculative: SpeculativeConfig | None = None
    num_threads: int | None = Field(None, ge=1)
    # Seeds the engine-wide generator used by requests without their own seed.
    seed: int = 0
    # Who runs first (llmctl.serve.core.policy): "fcfs" = lower priority value, then arrival;
    # "fair" = strict priority classes (first listed = most urgent) with aging, and a fair
    # share of tokens between the tenants of one class.
    scheduling_policy: Literal["fcfs", "fair"] = "fcfs"
    priority_classes: tuple[str, ...] = DEFAULT_CLASSES
    # the class of a request that names none (or one not listed)
    default_priority_class: str = DEFAULT_CLASS
    # a waiting request rises one class per aging_seconds waited (fair): a request of the
    # k-th class (0-based) is in the first within k * aging_seconds
    aging_seconds: float = Field(30.0, gt=0)
    # a tenant's share of tokens relative to others (fair); unlisted tenants weigh 1
    tenant_weights: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    # LoRA adapters served at start: name (what requests send as ``model``) -> PEFT
    # directory (llmctl.serve.lora.adapter); more load at run time
    loras: dict[str, str] = Field(default_factory=dict)
    # distinct adapters among running sequences (so in one step): a step runs one small
    # matmul pair per adapter and fused linear, so more adapters cost more per step
    max_loras: int = Field(4, ge=1)
    # adapters of a higher rank are refused at load
    max_lora_rank: int = Field(64, ge=1)

    @field_validator("dtype", "kv_cache_dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value):
        return _DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value

    @field_validator("kv_cache_memory")
    @classmethod
    def _memory(cls, value: str | float) -> str | float:
        parse_memory(value)
        return value

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        classes = self.priority_classes
        if not classes or len(set(classes)) != len(classes):
            raise ValueError(f"priority_classes must be distinct names, at least one: {classes}")
        if self.default_priority_class not in classes:
            raise ValueError(f"default_priority_class {self.default_priority_class!r} is not "
                             f"one of priority_classes {classes}")
        if self.max_model_len is not None and not self.enable_chunked_prefill \
                and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be at least "
                             "max_model_len (a whole prompt is computed in one step)")
        return self


def make_engine_config(model: str, **kwargs) -> EngineConfig:
    """Build an :class:`EngineConfig`, turning validation errors into a ConfigError."""
    if isinstance(kwargs.get("speculative"), dict):
        kwargs["speculative"] = _validated(SpeculativeConfig, kwargs["speculative"])
    return _validated(EngineConfig, {"model": model, **kwargs})


def _validated(cls: type[BaseModel], data: dict) -> BaseModel:
    try:
        return cls(**data)
    except ValidationError as exc:
        problems = []
        unknown = False
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or cls.__name__
            problems.append(f"{where}: {err['msg']}")
            unknown |= err["type"] == "extra_forbidden"
        remedy = (f"allowed keys: {', '.join(cls.model_fields)}" if unknown
                  else "fix the value named above")
        raise ConfigError(f"invalid {cls.__name__}: " + "; ".join(problems), remedy) from None
