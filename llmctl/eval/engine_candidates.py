"""Candidates that run through llmctl's own engines: an engine directory from
``llmctl build-engine`` and the serving engine (``--backend serve``). They register with
:mod:`llmctl.eval.candidates`' registry like the adapters there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmctl.errors import ConfigError
from llmctl.eval.candidates import (
    Candidate,
    CandidateOptions,
    chat_prompt_ids,
    fingerprint_path,
)
from llmctl.eval.generative import Generation

# -- engines from ``llmctl build-engine`` ------------------------------------------------


class EngineCandidate(Candidate, kind="engine"):
    """An engine directory built by ``llmctl build-engine`` (``engine:DIR`` or a plain
    path that holds an ``llmctl-engine.json``), scored through its own runtime.

    Opening it checks the manifest against this machine and the files' hashes
    (``open_engine``). Logits come from ``Engine.logits`` (one fresh runtime sequence
    per window, every position's row), so PPL, KLD and top-1 agreement measure the
    built artifact itself (its precision, graph rewrites and kernels) against the
    reference. ``--dtype`` does not apply: the precision was fixed at build time.
    """

    priority = 15

    @classmethod
    def matches(cls, spec: str) -> bool:
        from llmctl.engines.manifest import is_engine_dir

        return spec.startswith("engine:") or is_engine_dir(Path(spec).expanduser())

    def __init__(self, spec: str, options: CandidateOptions) -> None:
        super().__init__(spec, options)
        from llmctl.engines.engine_dir import open_engine

        self.path = Path(spec.removeprefix("engine:")).expanduser()
        # a TensorRT-LLM directory refuses here, naming the server to run instead
        self.engine = open_engine(self.path, threads=options.threads)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self.engine.vocab_size)

    def describe(self) -> dict[str, Any]:
        m = self.engine.manifest
        return {"kind": self.kind, "reference": self.spec, "path": str(self.path),
                "target": m.target, "precision": m.precision, "provider": self.engine.provider,
                "source": m.source.reference, "source_sha256": m.source.sha256,
                "build_command": m.build.command,
                "sha256_quick": fingerprint_path(self.path)}

    def logits(self, input_ids: list[int]):
        import torch

        if len(input_ids) > self.engine.max_len:
            raise ConfigError(f"a window of {len(input_ids)} tokens exceeds the "
                              f"{self.engine.max_len} this engine was built for",
                              f"pass --ctx {self.engine.max_len} or less, or rebuild with a "
                              "larger --max-seq-len")
        return torch.from_numpy(self.engine.logits(list(input_ids)))

    def close(self) -> None:
        self.engine = None


# -- llmctl's own serving engine ---------------------------------------------------------


class ServeEngineCandidate(Candidate, kind="serve"):
    """A checkpoint scored through llmctl's serving engine (``--backend serve``): the
    weights as it loads them, its kernels and its paged KV cache, ``kv_cache_dtype``
    choosing the cache. Each window is one prefill step returning every position's row
    (:func:`llmctl.serve.model.scoring.prompt_logits`); with an 8-bit cache that prefill
    attends over the K/V as stored, so the rows carry the quantization error that
    generation sees. Chosen only by ``--backend serve`` (a checkpoint is HF's by default).
    """

    priority = 95
    MAX_LEN = 8192  # the longest window; the cache holds exactly one sequence this long

    def __init__(self, spec: str, options: CandidateOptions) -> None:
        super().__init__(spec, options)
        from llmctl.models.resolve import resolve_model
        from llmctl.serve.engine.llm_engine import LLMEngine
        from llmctl.serve.model.decoder import ModelSpec

        self.path = resolve_model(spec).path
        max_len = min(ModelSpec.from_dir(self.path).max_position_embeddings, self.MAX_LEN)
        block_size = 16
        self.engine = LLMEngine.from_args(
            spec, dtype=options.dtype, kv_cache_dtype=options.kv_cache_dtype,
            enable_prefix_caching=False, max_model_len=max_len, block_size=block_size,
            num_kv_blocks=-(-max_len // block_size), max_num_seqs=1,
            num_threads=options.threads)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self.engine.spec.vocab_size)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "reference": self.spec, "path": str(self.path),
                "sha256_quick": fingerprint_path(self.path), "dtype": self.options.dtype,
                "kv_cache": self.engine.kv_plan.dtype}

    def logits(self, input_ids: list[int]):
        from llmctl.serve.model.scoring import prompt_logits

        if len(input_ids) > self.engine.max_model_len:
            raise ConfigError(f"a window of {len(input_ids)} tokens exceeds the engine's "
                              f"{self.engine.max_model_len}",
                              f"pass --ctx {self.engine.max_model_len} or less")
        return prompt_logits(self.engine, list(input_ids))

    def chat(self, messages: list[dict], max_tokens: int, *, thinking: bool = True
             ) -> Generation:
        from llmctl.serve.core.sampling_params import SamplingParams

        ids = chat_prompt_ids(self.tokenizer, messages, thinking)
        budget = self.engine.max_model_len - len(ids)
        if budget < 1:
            raise ConfigError(f"a prompt of {len(ids)} tokens leaves no room in the engine's "
                              f"{self.engine.max_model_len}", "shorten the task's prompts")
        self._chats = getattr(self, "_chats", 0) + 1
        request_id = f"eval-chat-{self._chats}"
        self.engine.add_request(request_id, ids, SamplingParams(
            temperature=0, max_tokens=min(max_tokens, budget)))
        while True:
            for out in self.engine.step():
                if out.request_id == request_id and out.finished:
                    if out.error:
                        raise ConfigError(f"the engine failed an answer: {out.error}",
                                          "see the log")
                    done = out.outputs[0]
                    return Generation(done.text, None, done.finish_reason or "stop")

    def close(self) -> None:
        self.engine = None
