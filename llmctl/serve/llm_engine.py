"""``LLMEngine``: requests in, tokens out, one ``step()`` at a time.

API (what the HTTP server drives)::

    engine = LLMEngine.from_args("smollm2-135m", dtype="bfloat16", kv_cache_memory="1GiB")
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=32), priority=0)
    while engine.has_unfinished_requests():
        for out in engine.step():          # list[RequestOutput], one per request that
            ...                            # got tokens or finished in this step
    engine.abort_request("r1")             # its final output (finish_reason "abort")
    engine.stats()                         # comes from the next step()

- ``add_request(request_id, prompt, params=None, *, priority=0, arrival_time=None)``:
  ``prompt`` is text (tokenized here, special tokens added) or a list of token ids.
  Validation happens in the caller and raises: :class:`~llmctl.errors.UsageError`
  (empty prompt, duplicate id, token id out of range) or
  :class:`~llmctl.errors.ResourceError` (prompt + max_tokens over the context length).
  ``max_tokens=None`` means "up to the context length". Lower ``priority`` runs first.
- ``step()`` schedules, runs the model once and returns snapshots
  (:class:`~llmctl.serve.outputs.RequestOutput`); ``new_token_ids`` / ``text_delta``
  are what changed since the request's previous output (stream them), ``token_ids`` /
  ``text`` are cumulative, ``finished`` marks the last output of a request.
- Structured output (``params.logits_constraint``): each sequence's constraint masks
  its logits before sampling and ends it when complete; such sequences get no draft
  tokens (speculative decoding would have to mask and advance the grammar through
  every draft position and roll it back on rejection; skipping drafts is simply exact).
- Prompt log-probs (``params.prompt_logprobs``): the runner also returns the rows of
  the prompt positions of that request, and its prompt skips the prefix cache until
  they are all collected. Runners without ``execute_with_prompt`` (engine directories)
  refuse such requests.
- ``stats()`` returns a flat dict: num_running, num_waiting, kv_cache_usage,
  prefix_cache_hit_rate, num_preemptions, token counters, speculative acceptance.

Threads: ``add_request`` and ``abort_request`` may be called from any thread: they
validate in the caller and queue the change under a lock; ``step()`` applies queued
changes first. ``step()``, ``has_unfinished_requests()`` and ``stats()`` must be called
from one thread at a time (the server's engine loop). No other locking, no threads of
its own: the engine is a plain object.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque

import torch

from llmctl.errors import ConfigError, ResourceError, UsageError
from llmctl.serve.block_manager import BlockManager
from llmctl.serve.config import EngineConfig, make_engine_config
from llmctl.serve.detokenizer import IncrementalDetokenizer
from llmctl.serve.kv_cache import KVCachePlan, allocate_kv_cache, available_memory, plan_kv_cache
from llmctl.serve.model import LlamaModel, ModelSpec
from llmctl.serve.model_runner import LogitRows, ModelRunner, PromptLogits
from llmctl.serve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmctl.serve.rejection_sampler import greedy_verify, rejection_sample
from llmctl.serve.sampler import Sampler, generator_for
from llmctl.serve.sampling_params import SamplingParams
from llmctl.serve.scheduler import Scheduler
from llmctl.serve.sequence import Request, Sequence, SequenceStatus
from llmctl.serve.spec_decode import DraftModelProposer, NgramProposer

log = logging.getLogger("llmctl.serve")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Built:
    """A model with its cache, block manager and runner (the target, or a draft model)."""

    def __init__(self, path, config: EngineConfig, device: torch.device, max_len: int,
                 num_blocks: int | None = None) -> None:
        from llmctl.serve.weights import load_model

        self.spec = ModelSpec.from_dir(path)
        dtype = _DTYPES.get(config.dtype if config.dtype != "auto" else self.spec.torch_dtype,
                            torch.float32)
        self.model: LlamaModel = load_model(path, dtype=dtype, device=device,
                                            backend=config.quant_backend, max_len=max_len,
                                            spec=self.spec)
        kv_dtype = dtype if config.kv_cache_dtype == "auto" else _DTYPES[config.kv_cache_dtype]
        spec = self.spec
        self.plan: KVCachePlan = plan_kv_cache(
            num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            itemsize=torch.tensor([], dtype=kv_dtype).element_size(),
            block_size=config.block_size, budget=config.kv_cache_memory,
            max_num_seqs=config.max_num_seqs, max_model_len=max_len,
            num_blocks=num_blocks or config.num_kv_blocks,
            available=available_memory(device.type))
        self.kv_cache = allocate_kv_cache(self.plan, num_layers=spec.num_layers,
                                          num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                                          dtype=kv_dtype, device=device)
        self.runner = ModelRunner(self.model, self.kv_cache, config.block_size)


class _PromptAwareBlockManager(BlockManager):
    """A request collecting prompt log-probs must compute every prompt position: a
    cached prefix would skip them (vLLM's KV cache manager makes the same exception)."""

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        if seq.request.needs_prompt_logits:
            return []
        return super().find_cached_prefix(seq)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self._load(config)
        self.spec = self.target.spec
        self.kv_plan = self.target.plan
        log.info("%s", self.kv_plan.describe())
        self.block_manager = _PromptAwareBlockManager(
            self.kv_plan.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_chunked_prefill=config.enable_chunked_prefill)
        self.runner = self.target.runner
        self.sampler = Sampler(config.seed)
        self.eos_token_ids = frozenset(self.spec.eos_token_ids or self._fallback_eos_ids())
        self.proposer = self._make_proposer(self.max_model_len)
        self._draft_probs: dict[int, torch.Tensor | None] = {}  # the proposer's q per step

        self._lock = threading.Lock()
        self._inbox: deque[tuple[str, object]] = deque()
        self._known_ids: set[str] = set()
        self.requests: dict[str, Request] = {}
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "cached_prompt_tokens": 0,
                         "num_requests_finished": 0, "num_steps": 0, "spec_draft_tokens": 0,
                         "spec_accepted_tokens": 0, "spec_verify_steps": 0}
        # The model, tokenizer and libraries are tens of thousands of long-lived objects:
        # freezing them keeps the cyclic GC from rescanning them every time a step's
        # small objects trigger a collection (vLLM's engine does the same).
        gc.collect()
        gc.freeze()

    # --- what a model is: the one part an engine directory replaces ------------------------
    def _load(self, config: EngineConfig) -> None:
        """Set ``model_path``, ``max_model_len``, ``tokenizer`` and ``target`` (spec, KV
        plan, runner) from a checkpoint: torch weights on the paged runner."""
        from llmctl.models.loading import load_tokenizer
        from llmctl.models.resolve import resolve_model

        self.model_path = resolve_model(config.model).path
        spec = ModelSpec.from_dir(self.model_path)
        self.max_model_len = self._check_max_len(config, spec.max_position_embeddings)
        self.tokenizer = load_tokenizer(resolve_model(config.tokenizer).path
                                        if config.tokenizer else self.model_path)
        self.target = _Built(self.model_path, config, self.device, self.max_model_len)

    @staticmethod
    def _check_max_len(config: EngineConfig, limit: int) -> int:
        max_len = min(config.max_model_len or limit, limit)
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_len:
            raise ConfigError(
                f"without chunked prefill a prompt of up to max_model_len={max_len} tokens "
                f"must fit in one step of max_num_batched_tokens="
                f"{config.max_num_batched_tokens}",
                "enable chunked prefill, or lower max_model_len / raise max_num_batched_tokens")
        return max_len

    def _fallback_eos_ids(self) -> list[int]:
        """EOS ids when the model's config names none."""
        eos = self.tokenizer.eos_token_id
        return [eos] if eos is not None else []

    @classmethod
    def from_args(cls, model: str, **kwargs) -> LLMEngine:
        return cls(make_engine_config(model, **kwargs))

    def _make_proposer(self, max_len: int):
        spec_cfg = self.config.speculative
        if spec_cfg is None:
            return None
        if spec_cfg.method == "ngram":
            return NgramProposer(spec_cfg.num_speculative_tokens, spec_cfg.ngram_min,
                                 spec_cfg.ngram_max)
        from llmctl.models.resolve import resolve_model

        draft_path = resolve_model(spec_cfg.draft_model).path
        draft = _Built(draft_path, self.config, self.device, max_len,
                       num_blocks=self.kv_plan.num_blocks)
        if draft.spec.vocab_size != self.spec.vocab_size:
            raise ConfigError(
                f"the draft model's vocabulary ({draft.spec.vocab_size}) differs from the "
                f"target's ({self.spec.vocab_size})",
                "use a draft model with the same tokenizer as the target")
        self.draft = draft
        return DraftModelProposer(draft.runner, BlockManager(draft.plan.num_blocks,
                                                             self.config.block_size, False),
                                  spec_cfg.num_speculative_tokens, self.sampler)

    # --- requests in ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, *, priority: int = 0,
                    arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        else:
            text, ids = None, [int(t) for t in prompt]
        if not ids:
            raise UsageError(f"request {request_id!r} has an empty prompt",
                             "send at least one token")
        vocab = self.spec.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise UsageError(f"request {request_id!r} has token ids outside [0, {vocab})",
                             "encode the prompt with this model's tokenizer")
        if params.prompt_logprobs is not None and \
                not hasattr(self.runner, "execute_with_prompt"):
            raise UsageError("this engine's runner cannot return prompt log-probs",
                             "serve the checkpoint instead of the engine directory, or do "
                             "not ask for prompt logprobs (echo with logprobs)")
        room = self.max_model_len - len(ids)
        if params.max_tokens is None:
            if room < 1:
                raise ResourceError(
                    f"the prompt has {len(ids)} tokens; the context length is "
                    f"{self.max_model_len}", "shorten the prompt")
            params = params.model_copy(update={"max_tokens": room})
        elif params.max_tokens > room:
            raise ResourceError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context length ({self.max_model_len})",
                "lower max_tokens or shorten the prompt")
        request = Request(request_id, ids, params, prompt=text, priority=priority,
                          arrival_time=time.time() if arrival_time is None else arrival_time,
                          eos_token_ids=self.eos_token_ids)
        with self._lock:
            if request_id in self._known_ids:
                raise UsageError(f"request id {request_id!r} is already in use",
                                 "give every request a unique id")
            self._known_ids.add(request_id)
            self._inbox.append(("add", request))

    def abort_request(self, request_id: str) -> None:
        """Stop a request; unknown or finished ids are ignored."""
        with self._lock:
            self._inbox.append(("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_unfinished()

    def _drain_inbox(self) -> list[RequestOutput]:
        outputs = []
        while True:
            with self._lock:
                if not self._inbox:
                    return outputs
                kind, item = self._inbox.popleft()
            if kind == "add":
                request = item
                self.requests[request.request_id] = request
                seq = request.seqs[0]
                seq.detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                   request.params)
                self.scheduler.add(seq)
            else:
                request = self.requests.get(item)
                if request is None:
                    continue
                request.seqs[0].pending_fork = 0
                for seq in request.seqs:
                    if not seq.finished:
                        self._finish(seq, SequenceStatus.FINISHED_ABORTED)
                outputs.append(self._output(request, request.seqs))
                self._retire(request)

    # --- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self._drain_inbox()
        if self.proposer is not None:
            self._propose()
        sched = self.scheduler.schedule()
        if sched.empty:
            return outputs
        now = time.time()
        self.counters["num_steps"] += 1
        for item in sched.scheduled:
            req = item.seq.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            if item.seq.num_computed_tokens < item.seq.num_prompt_tokens:
                self.counters["prompt_tokens"] += item.num_new_tokens
        self.runner.copy_blocks(sched.copies)
        if any(item.seq.request.needs_prompt_logits for item in sched.scheduled):
            logits, rows, prompt = self.runner.execute_with_prompt(sched.scheduled)
            self._collect_prompt_logprobs(prompt)
        else:
            logits, rows = self.runner.execute(sched.scheduled)
        for item in sched.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens - item.num_spec_tokens

        new_tokens = self._sample(logits, rows)
        touched: dict[str, list[Sequence]] = {}
        for seq, tokens, logprobs in new_tokens:
            self._append(seq, tokens, logprobs)
            touched.setdefault(seq.request.request_id, []).append(seq)
        for item in sched.scheduled:
            seq = item.seq
            if not seq.finished:
                self.block_manager.commit(seq)
        for req_id, seqs in touched.items():
            request = self.requests[req_id]
            outputs.append(self._output(request, seqs))
            if request.finished:
                self._retire(request)
        return outputs

    def _collect_prompt_logprobs(self, parts: list[PromptLogits]) -> None:
        for part in parts:
            request = part.item.seq.request
            targets = request.prompt_token_ids[part.first:part.first + part.logits.shape[0]]
            entries = Sampler.logprobs(part.logits, targets,
                                       [request.params.prompt_logprobs] * len(targets))
            request.add_prompt_logprobs(part.first, entries)

    def _propose(self) -> None:
        seqs, limits = [], []
        for seq in self.scheduler.running:
            params = seq.params
            # constrained sequences are not drafted for (see the module docstring)
            if seq.num_uncomputed_tokens != 1 or params.needs_penalties or seq.pending_fork \
                    or seq.constraint is not None:
                continue
            limit = min(params.max_tokens - seq.num_output_tokens - 1,
                        self.max_model_len - seq.num_tokens - 1)
            if limit > 0:
                seqs.append(seq)
                limits.append(limit)
        self._draft_probs = {}
        if not seqs:
            return
        for seq, (draft, q) in zip(seqs, self.proposer.propose(seqs, limits)):
            seq.spec_token_ids = list(draft)
            self._draft_probs[seq.seq_id] = q

    def _sample(self, logits: torch.Tensor, rows: list[LogitRows]
                ) -> list[tuple[Sequence, list[int], list | None]]:
        """New tokens per sequence: plain rows in one batch, speculative rows verified."""
        plain_rows: list[int] = []
        plain_seqs: list[Sequence] = []
        results: list[tuple[Sequence, list[int], list | None]] = []
        for r in rows:
            seq = r.item.seq
            if r.count == 1:
                plain_rows.append(r.start)
                plain_seqs.append(seq)
                for child in self._fork(seq):
                    plain_rows.append(r.start)
                    plain_seqs.append(child)
        if plain_rows:
            whole = plain_rows == list(range(logits.shape[0]))
            sub = logits if whole else logits[plain_rows]
            tokens = self.sampler.sample(sub, plain_seqs)
            top_n = [s.params.logprobs for s in plain_seqs]
            lps = (Sampler.logprobs(sub, tokens, [n or 0 for n in top_n])
                   if any(n is not None for n in top_n) else None)
            for i, seq in enumerate(plain_seqs):
                results.append((seq, [tokens[i]], [lps[i]] if lps and top_n[i] is not None
                                else None))
        spec = [r for r in rows if r.count > 1]
        if spec:
            results.extend(self._verify(spec, logits))
        return results

    def _verify(self, spec: list[LogitRows], logits: torch.Tensor
                ) -> list[tuple[Sequence, list[int], list | None]]:
        """Accept or reject each sequence's draft tokens (one batched pass over the rows)."""
        sampled = [r for r in spec if not r.item.seq.params.greedy]
        probs: dict[int, torch.Tensor] = {}
        if sampled:
            index = [r.start + j for r in sampled for j in range(r.count)]
            params = [r.item.seq.params for r in sampled for _ in range(r.count)]
            seqs = [r.item.seq for r in sampled for _ in range(r.count)]
            p = self.sampler.processed_logits(logits[index], params, seqs).softmax(dim=-1)
            offset = 0
            for r in sampled:
                probs[r.item.seq.seq_id] = p[offset:offset + r.count]
                offset += r.count
        greedy = [r for r in spec if r.item.seq.params.greedy]
        argmax = {}
        if greedy:
            index = [r.start + j for r in greedy for j in range(r.count)]
            flat = logits[index].argmax(dim=-1).tolist()
            offset = 0
            for r in greedy:
                argmax[r.item.seq.seq_id] = flat[offset:offset + r.count]
                offset += r.count
        results = []
        for r in spec:
            seq = r.item.seq
            draft = list(seq.spec_token_ids[:r.item.num_spec_tokens])
            if seq.seq_id in argmax:
                tokens = greedy_verify(draft, argmax[seq.seq_id])
            else:
                q = self._draft_probs.get(seq.seq_id)
                tokens = rejection_sample(draft, probs[seq.seq_id],
                                          None if q is None else q[:len(draft)],
                                          generator_for(seq) or self.sampler.generator)
            accepted = len(tokens) - 1
            self.counters["spec_draft_tokens"] += len(draft)
            self.counters["spec_accepted_tokens"] += accepted
            self.counters["spec_verify_steps"] += 1
            seq.num_computed_tokens += accepted
            seq.spec_token_ids = []
            lps = None
            if seq.params.logprobs is not None:
                lps = Sampler.logprobs(logits[r.start:r.start + len(tokens)], tokens,
                                       [seq.params.logprobs] * len(tokens))
            results.append((seq, tokens, lps))
        return results

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Siblings of an n > 1 request share the prompt's blocks from its first token on."""
        if not parent.pending_fork:
            return []
        request = parent.request
        children = []
        for index in range(1, request.params.n):
            child = Sequence(request, index, list(parent.token_ids))
            child.pending_fork = 0
            self.block_manager.fork(parent, child)
            child.detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                 request.params)
            self.scheduler.add_running(child)
            request.seqs.append(child)
            children.append(child)
        parent.pending_fork = 0
        return children

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list | None) -> None:
        """Add sampled tokens one by one, stopping at the first stop condition."""
        params = seq.params
        stop_ids = params.stop_token_ids
        now = time.time()
        if seq.first_token_time is None:
            seq.first_token_time = now
        status = None
        for i, token in enumerate(tokens):
            seq.token_ids.append(token)
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
            self.counters["generation_tokens"] += 1
            if token in seq.request.eos_token_ids or token in stop_ids:
                seq._stop_reason = token if token in stop_ids else None
                status = SequenceStatus.FINISHED_STOPPED
            elif seq.detok.append(token):
                seq._stop_reason = seq.detok.stop_reason
                status = SequenceStatus.FINISHED_STOPPED
            elif seq.constraint is not None and self._advance_constraint(seq, token):
                status = SequenceStatus.FINISHED_STOPPED
            elif seq.num_output_tokens >= params.max_tokens or \
                    seq.num_tokens >= self.max_model_len:
                status = SequenceStatus.FINISHED_LENGTH
            if status is not None:
                if i + 1 < len(tokens):  # accepted drafts past the stop are dropped
                    seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
                break
        if self.proposer is not None and seq.status is SequenceStatus.RUNNING:
            self.proposer.accepted(seq)
        self.block_manager.trim(seq, seq.num_tokens)  # blocks of rejected drafts
        if status is not None:
            self.block_manager.commit(seq)
            self._finish(seq, status)

    @staticmethod
    def _advance_constraint(seq: Sequence, token: int) -> bool:
        """Feed an appended output token to the sequence's constraint (once per token,
        whatever recomputation happens later); True when it can take no more."""
        seq.constraint.accept(token)
        return seq.constraint.is_finished()

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.scheduler.finish(seq, status)
        seq.detok.finish()
        if self.proposer is not None:
            self.proposer.release(seq)

    def _retire(self, request: Request) -> None:
        request.finish_time = time.time()
        self.counters["num_requests_finished"] += 1
        self.counters["cached_prompt_tokens"] += request.seqs[0].num_cached_tokens
        self.requests.pop(request.request_id, None)
        with self._lock:
            self._known_ids.discard(request.request_id)

    def _output(self, request: Request, changed: list[Sequence]) -> RequestOutput:
        outputs = []
        for seq in request.seqs:
            out_ids = seq.output_token_ids
            outputs.append(CompletionOutput(
                index=seq.index, token_ids=list(out_ids), text=seq.detok.visible_text,
                new_token_ids=[], text_delta="", finish_reason=seq.finish_reason,
                stop_reason=seq._stop_reason,
                logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None))
        for seq in changed:
            out = outputs[request.seqs.index(seq)]
            out.text_delta = seq.detok.delta()
            out.new_token_ids = out.token_ids[seq.num_emitted:]
            seq.num_emitted = len(out.token_ids)
        prompt_lps = request.prompt_logprobs
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids, outputs=outputs,
            finished=request.finished,
            prompt_logprobs=None if prompt_lps is None else list(prompt_lps),
            metrics=RequestMetrics(
                arrival_time=request.arrival_time,
                first_scheduled_time=request.first_scheduled_time,
                first_token_time=min((s.first_token_time for s in request.seqs
                                      if s.first_token_time is not None), default=None),
                finish_time=time.time() if request.finished else None,
                num_cached_tokens=request.seqs[0].num_cached_tokens))

    # --- introspection -------------------------------------------------------------------------
    def stats(self) -> dict:
        bm = self.block_manager
        sched = self.scheduler
        allocated, used = self._kv_slots()
        c = self.counters
        drafts = c["spec_draft_tokens"]
        return {
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "kv_cache_usage": bm.usage,
            "kv_cache_blocks": bm.num_blocks,
            "kv_cache_tokens": bm.num_blocks * bm.block_size,
            "kv_slots_allocated": allocated,
            "kv_slots_used": used,
            "prefix_cache_hit_rate": bm.stats.hit_rate,
            "prefix_cache_queried_tokens": bm.stats.queried_tokens,
            "prefix_cache_hit_tokens": bm.stats.hit_tokens,
            "num_preemptions": sched.num_preemptions,
            "spec_acceptance_rate": c["spec_accepted_tokens"] / drafts if drafts else 0.0,
            "spec_mean_accepted_per_step": (c["spec_accepted_tokens"] / c["spec_verify_steps"]
                                            if c["spec_verify_steps"] else 0.0),
            **c,
        }

    def _kv_slots(self) -> tuple[int, int]:
        """Slots in blocks held by running sequences, and how many of them hold a token."""
        filled: dict[int, int] = {}
        bs = self.block_manager.block_size
        for seq in self.scheduler.running:
            for i, block_id in enumerate(seq.block_table):
                n = min(bs, max(0, seq.num_computed_tokens - i * bs))
                if n > filled.get(block_id, -1):
                    filled[block_id] = n
        return len(filled) * bs, sum(filled.values())
