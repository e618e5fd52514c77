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
  ``tenant`` and ``priority_class`` feed the "fair" scheduling policy
  (:mod:`llmctl.serve.core.policy`); ``deadline`` (wall time) is kept on the request.
  ``lora`` names a loaded LoRA adapter (:meth:`add_lora`, ``config.loras``) the request
  runs with; requests of different adapters and the base model share steps
  (:mod:`llmctl.serve.lora.batch`). ``add_lora``/``remove_lora`` may come from any thread.
- ``step()`` schedules, runs the model once and returns snapshots
  (:class:`~llmctl.serve.engine.outputs.RequestOutput`); ``new_token_ids`` / ``text_delta``
  are what changed since the request's previous output (stream them), ``token_ids`` /
  ``text`` are cumulative, ``finished`` marks the last output of a request.
- Structured output (``params.logits_constraint``): each sequence's constraint masks
  its logits before sampling and ends it when complete; such sequences get no draft
  tokens (speculative decoding would have to mask and advance the grammar through
  every draft position and roll it back on rejection; skipping drafts is simply exact).
  ``params.logit_bias`` is added to the logits next to the mask; biased sequences get
  no drafts either (verification reads the unbiased logits).
- Prompt log-probs (``params.prompt_logprobs``): the runner also returns the rows of
  the prompt positions of that request, and its prompt skips the prefix cache until
  they are all collected. Targets that do not serve them
  (``Target.serves_prompt_logprobs``) refuse such requests.
- Embeddings (``params.pooling``, :mod:`llmctl.serve.core.pooling`): prefill only, no
  sampling; the step that completes the prompt finishes the request (blocks freed, none
  committed) with its output's ``embedding``. Mean pooling skips the prefix cache.
- ``stats()`` returns an :class:`~llmctl.serve.engine.stats.EngineStats`: num_running,
  num_waiting, kv_cache_usage, prefix_cache_hit_rate, num_preemptions, token counters,
  speculative acceptance, and deadline admission's inputs (admission_rate, queued_work:
  :mod:`llmctl.serve.core.admission`).

What the model is comes from a :class:`~llmctl.serve.engine.target.Target` (a
checkpoint by default, :mod:`llmctl.serve.engine.loader`; an engine directory brings its
own); the tokens each sequence gets from its logits from :mod:`llmctl.serve.sample.
token_choice`; the ``RequestOutput`` snapshots from :mod:`llmctl.serve.engine.
output_processor`.

Threads: ``add_request`` and ``abort_request`` may be called from any thread: they
validate in the caller and queue the change under a lock; ``step()`` applies queued
changes first. ``step()``, ``has_unfinished_requests()`` and ``stats()`` must be called
from one thread at a time (the server's engine loop). No other locking, no threads of
its own: the engine is a plain object.

Failures: one request never hurts another (:mod:`llmctl.serve.engine.isolation` says
how: checks in ``add_request``, per-request work under a guard, batched work run again
one sequence at a time when it raises, failed requests ended at the end of the step).
An exception that escapes ``step()`` is the engine's own fault: stop stepping it.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque

import torch

from llmctl.errors import UsageError
from llmctl.perf.meter import StepMeter, step_load
from llmctl.serve.core.admission import RateMeter
from llmctl.serve.core.block_manager import BlockManager
from llmctl.serve.core.policy import make_policy
from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.core.scheduler import ScheduledSeq, Scheduler
from llmctl.serve.core.sequence import Request, Sequence, SequenceStatus
from llmctl.serve.engine.config import EngineConfig, make_engine_config
from llmctl.serve.engine.detokenizer import IncrementalDetokenizer
from llmctl.serve.engine.isolation import FailureIsolation
from llmctl.serve.engine.loader import CheckpointTarget, load_draft, load_loras
from llmctl.serve.engine.output_processor import OutputProcessor
from llmctl.serve.engine.outputs import RequestOutput
from llmctl.serve.engine.request_checks import check_request
from llmctl.serve.engine.stats import EngineCounters, EngineStats, kv_slots, queued_work
from llmctl.serve.engine.target import Target
from llmctl.serve.lora.adapter import LoRAError, LoRARegistry
from llmctl.serve.model.runner import LogitRows, PooledRows, PromptRows
from llmctl.serve.sample.sampler import Sampler
from llmctl.serve.sample.spec_decode import DraftModelProposer, NgramProposer
from llmctl.serve.sample.token_choice import append_tokens, draw, verify
from llmctl.utils.dtypes import short_name

log = logging.getLogger("llmctl.serve")


class _PromptAwareBlockManager(BlockManager):
    """A request collecting prompt log-probs (or mean-pooling its prompt) must compute
    every prompt position: a cached prefix would skip them (vLLM's KV cache manager makes
    the same exception)."""

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        pooled = seq.request.pooled
        if seq.request.needs_prompt_logits or (pooled is not None and pooled.every_position):
            return []
        return super().find_cached_prefix(seq)


# The phases of step(), in order: taking queued requests in and choosing the batch
# (schedule), the model pass with KV-cache writes (forward), sampling (sample), appending
# tokens with detokenization, stop checks and block commits (update), and building the
# RequestOutputs (output).
STEP_PHASES = ("schedule", "forward", "sample", "update", "output")


class LLMEngine:
    def __init__(self, config: EngineConfig, target: Target | None = None) -> None:
        """``target``: the model to serve; None loads ``config.model`` as a checkpoint."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.target = target = CheckpointTarget(config) if target is None else target
        self.device = target.device
        self.tokenizer = target.tokenizer
        self.max_model_len = target.max_model_len
        self.spec = target.spec
        self.kv_plan = target.plan
        log.info("%s", self.kv_plan.describe())
        # blocks out of every layer's sliding window are released as sequences grow
        self.block_manager = _PromptAwareBlockManager(
            self.kv_plan.num_blocks, config.block_size, config.enable_prefix_caching,
            sliding_window=self.spec.kv_window)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   policy=make_policy(config), max_loras=config.max_loras)
        self.runner = target.runner
        self.loras = load_loras(target, config)
        self.sampler = Sampler(config.seed)
        self.eos_token_ids = frozenset(self.spec.eos_token_ids or target.fallback_eos_ids())
        self.proposer = self._make_proposer(self.max_model_len)
        self._draft_probs: dict[int, torch.Tensor | None] = {}  # the proposer's q per step

        self._lock = threading.Lock()
        self._inbox: deque[tuple[str, object]] = deque()
        self._known_ids: set[str] = set()
        # failures (llmctl.serve.engine.isolation); its methods bound here for the hot path
        self.isolation = FailureIsolation()
        self._guard, self._fail = self.isolation.guard, self.isolation.fail
        self._isolated = self.isolation.isolated
        self.counters = EngineCounters()
        # tokens/s of recent saturated steps, output fraction: deadline admission's inputs
        self.rate_meter = RateMeter()
        self.output_processor = OutputProcessor(self.counters, self.rate_meter, self._forget)
        self.requests: dict[str, Request] = self.output_processor.requests
        # Wall seconds spent in each phase of step(), summed (STEP_PHASES): where a
        # step's time goes, offline and behind the server alike (/metrics).
        self.phase_seconds = dict.fromkeys(STEP_PHASES, 0.0)
        # FLOPs, bytes and seconds of every step by phase (llmctl.perf.meter): the MFU/MBU
        # counters and gauges of /metrics
        self.meter = StepMeter()
        self._step_cost = target.perf_cost()
        dtype = target.dtype
        self.perf_dtype = (short_name(dtype) if dtype is not None else None) or "unknown"
        # The model, tokenizer and libraries are tens of thousands of long-lived objects:
        # freezing them keeps the cyclic GC from rescanning them every time a step's
        # small objects trigger a collection (vLLM's engine does the same).
        gc.collect()
        gc.freeze()

    # --- LoRA adapters (any thread) ---------------------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter at ``path`` under ``name`` (requests send it as their
        ``model``); raises :class:`~llmctl.serve.lora.adapter.LoRAError` if it cannot."""
        self._require_loras().load(name, path)

    def remove_lora(self, name: str) -> None:
        """New requests can no longer name it; running ones finish with it (they hold it).
        Raises :class:`~llmctl.serve.lora.adapter.LoRANotFoundError` if not loaded."""
        self._require_loras().unload(name)

    def lora_names(self) -> tuple[str, ...]:
        return () if self.loras is None else self.loras.names()

    def _require_loras(self) -> LoRARegistry:
        if self.loras is None:
            raise LoRAError("this engine cannot serve LoRA adapters (an engine directory's "
                            "runtime holds its own weights)", "serve the source checkpoint")
        return self.loras

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
        draft = load_draft(self.config, self.device, max_len, self.kv_plan.num_blocks,
                           self.tokenizer, self.spec.vocab_size)
        self.draft = draft
        return DraftModelProposer(draft.runner, BlockManager(draft.plan.num_blocks,
                                                             self.config.block_size, False),
                                  spec_cfg.num_speculative_tokens, self.sampler)

    # --- requests in ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, *, priority: int = 0,
                    arrival_time: float | None = None, tenant: str | None = None,
                    priority_class: str | None = None, deadline: float | None = None,
                    lora: str | None = None) -> None:
        params = params or SamplingParams()
        adapter = None if lora is None else self._require_loras().get(lora)
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        else:
            text, ids = None, [int(t) for t in prompt]
        params = check_request(request_id, ids, params, vocab_size=self.spec.vocab_size,
                               max_model_len=self.max_model_len,
                               prompt_logprobs=self.target.serves_prompt_logprobs,
                               pooling=getattr(self.target, "serves_pooling", False))
        request = Request(request_id, ids, params, prompt=text, priority=priority,
                          arrival_time=time.time() if arrival_time is None else arrival_time,
                          eos_token_ids=self.eos_token_ids, tenant=tenant,
                          priority_class=priority_class, deadline=deadline, lora=adapter)
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
                with self._guard(request):
                    seq.detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                       request.params)
                if request.error is None:
                    self.scheduler.add(seq)
                else:  # never scheduled; _end_failed reports it
                    seq.transition(SequenceStatus.FINISHED_ERROR)
            else:
                request = self.requests.get(item)
                if request is None or request.error is not None:
                    continue  # unknown, retired, or failed (_end_failed ends it)
                request.seqs[0].pending_fork = 0
                for seq in request.seqs:
                    if not seq.finished:
                        self._finish(seq, SequenceStatus.FINISHED_ABORTED)
                with self._guard(request):
                    outputs.append(self.output_processor.output(request, request.seqs))
                    self.output_processor.retire(request)

    def _forget(self, request_id: str) -> None:
        """A retired request's id may be used again."""
        with self._lock:
            self._known_ids.discard(request_id)

    def _end_failed(self) -> list[RequestOutput]:
        """End each request that failed in this step: its unfinished sequences finish with
        "error" (blocks freed, nothing enters the prefix cache) and it gets its final output."""
        outputs = []
        for request in self.isolation.take_failed():
            if self.requests.get(request.request_id) is not request:
                continue  # already retired (aborted in the same step)
            request.seqs[0].pending_fork = 0
            for seq in request.seqs:
                if not seq.finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
                    if self.proposer is not None:
                        self.proposer.release(seq)
            outputs.append(self.output_processor.output(request, []))
            self.output_processor.retire(request)
        return outputs

    # --- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        outputs = self._drain_inbox()
        if self.proposer is not None:
            self._propose()
        sched = self.scheduler.schedule()
        if sched.preempted:  # when each request lost its KV (traces' preemption events)
            now = time.time()
            for seq in sched.preempted:
                seq.request.preemption_times += (now,)
        self.phase_seconds["schedule"] += time.perf_counter() - start
        if not sched.empty:
            metered = self._step_cost is not None
            if metered:  # what the step computes, taken before _run advances the sequences
                work = [(s.seq.num_computed_tokens, s.num_new_tokens) for s in sched.scheduled]
                phase = "prefill" if any(s.seq.num_computed_tokens < s.seq.num_prompt_tokens
                                         for s in sched.scheduled) else "decode"
            outputs.extend(self._run(sched.scheduled, sched.copies))
            seconds = time.perf_counter() - start
            if metered:
                cost, weights = self._step_cost
                self.meter.record(phase, step_load(cost, weights, work, seconds))
            self.rate_meter.record_step(sched.num_batched_tokens, seconds,
                                        saturated=bool(self.scheduler.waiting))
        outputs.extend(self._end_failed())
        return outputs

    def _run(self, scheduled: list[ScheduledSeq], copies: list[tuple[int, int]]
             ) -> list[RequestOutput]:
        """Compute the scheduled tokens, sample, and apply the results."""
        now = time.time()
        self.counters.num_steps += 1
        for item in scheduled:
            req = item.seq.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            if item.seq.num_computed_tokens < item.seq.num_prompt_tokens:
                self.counters.prompt_tokens += item.num_new_tokens
                if item.seq.first_token_time is None:  # a prefill chunk, for traces
                    req.prefill_chunks += ((now, item.num_new_tokens),)
        phases, mark = self.phase_seconds, time.perf_counter()
        self.runner.copy_blocks(copies)
        logits, rows, prompt = self._forward(scheduled)
        self._collect_prompt_rows(prompt)
        live = [item for item in scheduled if item.seq.request.error is None]
        touched: dict[str, list[Sequence]] = {}
        for item in live:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens - item.num_spec_tokens
            if seq.request.pooled is not None and seq.num_computed_tokens == seq.num_tokens:
                self._finish(seq, SequenceStatus.FINISHED_STOPPED)  # an embedding: done
                touched[seq.request.request_id] = [seq]
        now = time.perf_counter()
        phases["forward"] += now - mark
        mark = now

        new_tokens = self._sample(logits, [r for r in rows if r.item.seq.request.error is None])
        now = time.perf_counter()
        phases["sample"] += now - mark
        mark = now
        for seq, tokens, logprobs in new_tokens:
            if seq.request.error is None:  # (a sibling may have failed since)
                with self._guard(seq.request):
                    self._append(seq, tokens, logprobs)
                touched.setdefault(seq.request.request_id, []).append(seq)
        for item in live:
            seq = item.seq
            if not seq.finished and seq.request.error is None:
                self.block_manager.commit(seq)
        now = time.perf_counter()
        phases["update"] += now - mark
        mark = now
        outputs = self.output_processor.step_outputs(touched, self._guard)
        phases["output"] += time.perf_counter() - mark
        return outputs

    def _execute(self, items: list[ScheduledSeq]
                 ) -> tuple[torch.Tensor, list[LogitRows], list[PromptRows]]:
        if any(item.seq.request.needs_prompt_logits or item.seq.request.pooled is not None
               for item in items):
            return self.runner.execute_with_prompt(items)
        logits, rows = self.runner.execute(items)
        return logits, rows, []

    def _forward(self, scheduled: list[ScheduledSeq]
                 ) -> tuple[torch.Tensor, list[LogitRows], list[PromptRows]]:
        """The model pass over the step. If it raises, each sequence runs alone and the
        ones that raise alone fail their request; the others' rows come from their solo
        runs. Repeating the pass is safe: it only writes the KV slots of the tokens it
        computes, and no sequence has advanced yet."""
        try:
            return self._execute(scheduled)
        except Exception as exc:  # noqa: BLE001 - attributed below
            if len(scheduled) > 1:
                log.warning("the model pass over %d sequences failed (%s: %s); running "
                            "each alone to find the cause", len(scheduled),
                            type(exc).__name__, exc)
            else:
                self._fail(scheduled[0].seq.request, exc)
                scheduled = []
        parts: list[torch.Tensor] = []
        rows: list[LogitRows] = []
        prompt: list[PromptRows] = []
        offset = 0
        for item in scheduled:
            try:
                logits, item_rows, item_prompt = self._execute([item])
            except Exception as exc:  # noqa: BLE001 - this sequence's own failure
                self._fail(item.seq.request, exc)
                continue
            rows.extend(LogitRows(r.item, r.start + offset, r.count) for r in item_rows)
            parts.append(logits)
            prompt.extend(item_prompt)
            offset += logits.shape[0]
        logits = torch.cat(parts) if parts else torch.empty((0, self.spec.vocab_size))
        return logits, rows, prompt

    def _collect_prompt_rows(self, parts: list[PromptRows]) -> None:
        for part in parts:
            request = part.item.seq.request
            with self._guard(request):
                if isinstance(part, PooledRows):
                    request.pooled.add(part.first, part.hidden)
                    continue
                targets = request.prompt_token_ids[part.first:part.first + part.logits.shape[0]]
                entries = Sampler.logprobs(part.logits, targets,
                                           [request.params.prompt_logprobs] * len(targets))
                request.add_prompt_logprobs(part.first, entries)

    def _propose(self) -> None:
        seqs, limits = [], []
        for seq in self.scheduler.running:
            params = seq.params
            # constrained or biased sequences are not drafted for (see the module
            # docstring): draft verification compares against the unbiased logits; an
            # embedding's last prompt token samples nothing to verify
            if seq.num_uncomputed_tokens != 1 or params.needs_penalties or seq.pending_fork \
                    or seq.constraint is not None or params.logit_bias or seq.no_drafts \
                    or params.pooling is not None:
                continue
            limit = min(params.max_tokens - seq.num_output_tokens - 1,
                        self.max_model_len - seq.num_tokens - 1)
            if limit > 0:
                seqs.append(seq)
                limits.append(limit)
        self._draft_probs = {}
        if not seqs:
            return

        def without_drafts(seq: Sequence, exc: BaseException) -> None:
            # drafts only save time: the sequence goes on without them, exactly
            log.warning("drafts for request %r failed (%s: %s); it decodes without them",
                        seq.request.request_id, type(exc).__name__, exc)
            seq.no_drafts = True
            self.proposer.release(seq)

        proposals = self._isolated(
            lambda units: self.proposer.propose([s for s, _ in units], [n for _, n in units]),
            list(zip(seqs, limits)), seqs, on_fail=without_drafts)
        for seq, proposal in zip(seqs, proposals):
            if proposal is not None:
                seq.spec_token_ids = list(proposal[0])
                self._draft_probs[seq.seq_id] = proposal[1]

    def _sample(self, logits: torch.Tensor, rows: list[LogitRows]
                ) -> list[tuple[Sequence, list[int], list | None]]:
        """New tokens per sequence: plain rows in one batch, speculative rows verified."""
        plain: list[tuple[int, Sequence]] = []
        for r in rows:
            if r.count == 1:
                seq = r.item.seq
                children = self._fork(seq)
                if seq.request.error is None:
                    plain.extend((r.start, s) for s in [seq, *children])
        results: list[tuple[Sequence, list[int], list | None]] = []
        if plain:
            seqs = [s for _, s in plain]
            drawn = self._isolated(lambda units: draw(self.sampler, logits, units), plain,
                                   seqs)
            results.extend((seq, *out) for seq, out in zip(seqs, drawn) if out is not None)
        spec = [r for r in rows if r.count > 1]
        if spec:
            seqs = [r.item.seq for r in spec]
            counters = self.counters
            verified = self._isolated(
                lambda units: verify(self.sampler, units, logits, self._draft_probs), spec, seqs)
            for r, seq, out in zip(spec, seqs, verified):
                seq.spec_token_ids = []
                if out is None:
                    continue
                tokens, lps = out
                accepted = len(tokens) - 1
                counters.spec_draft_tokens += r.item.num_spec_tokens
                counters.spec_accepted_tokens += accepted
                counters.spec_verify_steps += 1
                seq.num_computed_tokens += accepted
                results.append((seq, tokens, lps))
        return results

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Siblings of an n > 1 request share the prompt's blocks from its first token on."""
        if not parent.pending_fork:
            return []
        request = parent.request
        parent.pending_fork = 0
        children = []
        with self._guard(request):  # the per-request parts first: a failure leaks nothing
            for index in range(1, request.params.n):
                child = Sequence(request, index, list(parent.token_ids))
                child.detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                     request.params)
                children.append(child)
        if request.error is not None:
            return []
        for child in children:
            self.block_manager.fork(parent, child)
            self.scheduler.add_running(child)
            request.seqs.append(child)
        return children

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list | None) -> None:
        """Add sampled tokens one by one, stopping at the first stop condition."""
        if seq.first_token_time is None:
            seq.first_token_time = time.time()
        before = seq.num_tokens
        try:
            status = append_tokens(seq, tokens, logprobs, self.max_model_len)
        finally:  # the tokens appended, a stop string's detokenizer failure or not
            self.counters.generation_tokens += seq.num_tokens - before
        if self.proposer is not None and seq.status is SequenceStatus.RUNNING:
            self.proposer.accepted(seq)
        self.block_manager.trim(seq, seq.num_tokens)  # blocks of rejected drafts
        if status is not None:
            self.block_manager.commit(seq)
            self._finish(seq, status)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.scheduler.finish(seq, status)
        seq.detok.finish()
        if self.proposer is not None:
            self.proposer.release(seq)

    # --- introspection -------------------------------------------------------------------------
    def admission_key(self, priority: int, priority_class: str | None) -> tuple:
        """Queued work whose key (``stats().queued_work``: (key, tokens) pairs) is at
        most this one goes before a new request of this priority and class. Any thread."""
        return self.scheduler.policy.admission_key(priority, priority_class)

    def queue_key(self, priority_class: str | None) -> tuple:
        """The queue (``stats().queued_requests``: (key, count) pairs) the server's
        queue limit counts for a new request of this class. Any thread."""
        return self.scheduler.policy.queue_key(priority_class)

    def wait_bound(self, priority_class: str | None) -> float | None:
        """Seconds a new request of this class waits at most, whatever is queued ahead
        (the fair policy's aging bound), or None. Any thread."""
        return self.scheduler.policy.wait_bound(priority_class)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        sched = self.scheduler
        allocated, used = kv_slots(sched.running, bm.block_size)
        c = self.counters
        drafts = c.spec_draft_tokens
        rate = self.rate_meter.estimate()
        with self._lock:  # the requests added, not yet taken in, are waiting too
            added = [item for kind, item in self._inbox if kind == "add"]
        work, count = queued_work([*sched.waiting, *(request.seqs[0] for request in added)],
                                  sched.policy, rate.output_fraction if rate else 1.0)
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=sum(n for _, n in count),
            kv_cache_usage=bm.usage,
            kv_cache_blocks=bm.num_blocks,
            kv_cache_tokens=bm.num_blocks * bm.block_size,
            kv_slots_allocated=allocated,
            kv_slots_used=used,
            prefix_cache_hit_rate=bm.stats.hit_rate,
            prefix_cache_queried_tokens=bm.stats.queried_tokens,
            prefix_cache_hit_tokens=bm.stats.hit_tokens,
            num_preemptions=sched.num_preemptions,
            spec_acceptance_rate=c.spec_accepted_tokens / drafts if drafts else 0.0,
            spec_mean_accepted_per_step=(c.spec_accepted_tokens / c.spec_verify_steps
                                         if c.spec_verify_steps else 0.0),
            **vars(c),
            step_phase_seconds=dict(self.phase_seconds),
            perf_totals=dict(self.meter.totals),
            perf_recent=self.meter.recent(),
            perf_dtype=self.perf_dtype,
            admission_rate=rate,
            queued_work=work,
            queued_requests=count,
        )
