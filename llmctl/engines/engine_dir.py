"""Open an engine directory: check it, load its runtime, and give serve/eval/bench one API.

::

    engine = open_engine("out/smollm2-onnx-int4")     # manifest + compatibility + integrity
    engine.provider                                   # what actually runs (ORT EP / "cpu")
    engine.generate([prompt_ids], max_tokens=32)      # batched greedy/sampled generation
    engine.logits(ids)                                # [len(ids), vocab] float32
    engine.token_logprobs(window)                     # log p(w[i] | w[:i]) for i >= 1
    engine.runtime.forward(states, chunks)            # the step-level primitive
    engine.runner()                                   # a ModelRunner for llmctl's scheduler

Where this is wired:

- ``llmctl serve ENGINE_DIR``: the model source this package registers with
  :mod:`llmctl.serve.engine.sources` (:mod:`llmctl.engines.serve_source`) claims it with
  :func:`is_engine_dir` and calls
  :func:`llmctl.engines.serve_engine.open_serving_engine`, which opens the engine
  here (manifest, host compatibility, file hashes) and builds an ``LLMEngine`` whose
  scheduler, sampler and detokenizer drive :meth:`Engine.runner` (see
  :mod:`llmctl.engines.serve_runner` for the contract and what is not supported).
- ``llmctl eval ENGINE_DIR`` (or ``engine:DIR``): ``EngineCandidate`` in
  :mod:`llmctl.eval.engine_candidates` returns :meth:`Engine.logits` (``torch.from_numpy``)
  as its ``Candidate.logits``, so PPL, KLD and top-1 agreement score the built artifact
  against the reference.
- ``llmctl bench``: through the server, like any other endpoint.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from llmctl.engines.manifest import (
    EngineManifest,
    check_compatible,
    integrity_problems,
    is_engine_dir,
    read_manifest,
)
from llmctl.engines.runtime import Runtime
from llmctl.engines.targets import get_target
from llmctl.errors import LlmctlError, UsageError

log = logging.getLogger(__name__)

__all__ = ["Engine", "is_engine_dir", "open_engine"]


class Engine:
    def __init__(self, path: Path, manifest: EngineManifest, runtime: Runtime) -> None:
        self.path = Path(path)
        self.manifest = manifest
        self.runtime = runtime
        self.config = json.loads((self.path / "config.json").read_text())
        self._tokenizer = None

    # --- facts -----------------------------------------------------------------------------
    @property
    def provider(self) -> str:
        return self.runtime.provider

    @property
    def vocab_size(self) -> int:
        return self.runtime.vocab_size

    @property
    def max_len(self) -> int:
        return self.runtime.max_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        gen = self.path / "generation_config.json"
        eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
        if eos is None:
            eos = self.config.get("eos_token_id")
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, list) else (int(eos),)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from llmctl.models.loading import load_tokenizer

            self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.path), "target": self.manifest.target,
                "precision": self.manifest.precision, "source": self.manifest.source.reference,
                **self.runtime.describe()}

    # --- scoring ---------------------------------------------------------------------------
    def logits(self, input_ids: Sequence[int]) -> np.ndarray:
        """Logits after every position of one sequence: ``[len(input_ids), vocab]``."""
        state = self.runtime.new_state()
        return self.runtime.forward([state], [list(input_ids)], all_logits=True)[0]

    def token_logprobs(self, window: Sequence[int]) -> np.ndarray:
        """``log p(window[i] | window[:i])`` for ``i = 1 .. len(window) - 1``."""
        if len(window) < 2:
            raise UsageError("a window needs at least two tokens", "pass a longer window")
        import torch

        lp = torch.log_softmax(torch.from_numpy(self.logits(window[:-1])).double(), dim=-1)
        return lp.numpy()[np.arange(len(window) - 1), np.asarray(window[1:])].astype(np.float32)

    # --- generation ------------------------------------------------------------------------
    def generate(self, prompts: Sequence[int] | Sequence[Sequence[int]], *, max_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 stop_token_ids: Sequence[int] = (), ignore_eos: bool = False
                 ) -> list[int] | list[list[int]]:
        """Generate for one prompt (a list of ids) or a batch (a list of lists).

        All prompts are prefilled (one call each), then decode together, one batched
        call per step; a finished sequence leaves the batch. Returns the new token ids
        (a stop / EOS token included, as the engine and HF generate do).

        Tokens are drawn by the serving engine's sampler (:mod:`llmctl.serve.sample.sampler`):
        prompt ``i`` with ``seed`` draws as a served request with ``seed + i`` would.
        """
        import torch
        single = len(prompts) > 0 and isinstance(prompts[0], (int, np.integer))
        batch = [list(prompts)] if single else [list(p) for p in prompts]
        if not batch or any(not p for p in batch):
            raise UsageError("every prompt needs at least one token", "pass token ids")
        if max_tokens < 1:
            raise UsageError(f"max_tokens must be >= 1, got {max_tokens}", "ask for a token")
        stops = set(stop_token_ids) | (set() if ignore_eos else set(self.eos_token_ids))
        generators = [None if seed is None else torch.Generator().manual_seed(seed + i)
                      for i in range(len(batch))]
        shared = torch.Generator()
        shared.seed()  # unseeded prompts: a fresh non-deterministic draw
        states = [self.runtime.new_state() for _ in batch]
        outputs: list[list[int]] = [[] for _ in batch]
        rows = self.runtime.forward(states, batch)
        live = list(range(len(batch)))
        while live:
            next_live, tokens = [], []
            drawn = _next_tokens(rows, temperature, top_p, [generators[i] for i in live], shared)
            for i, token in zip(live, drawn):
                outputs[i].append(token)
                if token not in stops and len(outputs[i]) < max_tokens and \
                        states[i].length < self.max_len:
                    next_live.append(i)
                    tokens.append(token)
            live = next_live
            if live:
                rows = self.runtime.forward([states[i] for i in live], [[t] for t in tokens])
        return outputs[0] if single else outputs

    def runner(self, **kwargs):
        """A ``ModelRunner``-compatible object for llmctl's serving engine."""
        from llmctl.engines.serve_runner import EngineRunner

        return EngineRunner(self, **kwargs)


def _next_tokens(rows, temperature: float, top_p: float, generators, shared) -> list[int]:
    """One token per row of last-position logits, with the serving engine's sampler."""
    import torch

    from llmctl.serve.sample.sampler import exponential_race, filter_logits

    logits = torch.from_numpy(np.stack([np.asarray(r, dtype=np.float32) for r in rows]))
    if temperature == 0.0:
        return logits.argmax(dim=-1).tolist()  # lowest id on ties
    logits = logits / temperature
    if top_p < 1.0:
        n = len(logits)
        logits = filter_logits(logits, torch.zeros(n, dtype=torch.long),
                               torch.full((n,), float(top_p)), torch.zeros(n))
    return exponential_race(logits.softmax(dim=-1), generators, shared).tolist()


def open_engine(path: str | Path, *, check: bool = True, verify_files: bool = True,
                **runtime_options: Any) -> Engine:
    """Read the manifest, check this machine and the files, and load the runtime.

    ``runtime_options`` go to the target's loader: ``device`` ("cpu" | "cuda" |
    "tensorrt" for ONNX), ``threads``, ``strict_provider`` (refuse a silent CPU
    fallback), ``max_batch_size``.
    """
    path = Path(path)
    manifest = read_manifest(path)
    if verify_files:
        problems = integrity_problems(path, manifest)
        if problems:
            raise LlmctlError(f"the engine at {path} is damaged: " + "; ".join(problems[:5]),
                              f"rebuild it: {manifest.build.command}")
    if check:
        check_compatible(manifest)
    runtime = get_target(manifest.target).open(path, manifest, **runtime_options)
    return Engine(path, manifest, runtime)
