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
  they are all collected. Runners without ``execute_with_prompt`` (engine directories)
  refuse such requests.
- ``stats()`` returns a flat dict: num_running, num_waiting, kv_cache_usage,
  prefix_cache_hit_rate, num_preemptions, token counters, speculative acceptance, and
  deadline admission's inputs (admission_rate, queued_work: :mod:`llmctl.serve.core.admission`).

Threads: ``add_request`` and ``abort_request`` may be called from any thread: they
validate in the caller and queue the change under a lock; ``step()`` applies queued
changes first. ``step()``, ``has_unfinished_requests()`` and ``stats()`` must be called
from one thread at a time (the server's engine loop). No other locking, no threads of
its own: the engine is a plain object.

Failures: one request never hurts another.

1. What can be checked is checked in ``add_request``, in the caller, which gets the
   exception (the request never enters the engine). That includes making the first
   sequence's constraint from its factory.
2. Per-request work in ``step()`` (a sequence's detokenizer, constraint updates, the
   forks of an ``n > 1`` request, prompt log-probs, building its output) runs under a
   guard: an exception fails that request only.
3. Batched work (the model pass, sampling with its constraint masks and seeded draws,
   draft verification, draft proposals) that raises is run again one sequence at a time,
   seeded generators put back first so each draws what it would have drawn in the batch;
   a sequence that raises alone fails its request, the others keep their solo results
   and the step goes on. Repeating the model pass is safe: it writes only the KV slots
   of the tokens it computes, and sequences advance only after it. A proposal that
   fails alone only costs its sequence the drafts (it decodes without them, exactly).
4. A failed request ends at the end of the step: its unfinished sequences finish with
   reason "error", its blocks are freed without entering the prefix cache, and its
   final ``RequestOutput`` carries ``error`` (the exception, as text).
5. An exception that escapes ``step()`` is the engine's own fault (scheduler or block
   bookkeeping), not a request's: its state can no longer be trusted, and the caller
   should stop stepping it (the server turns unhealthy and ends every stream).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from llmctl.errors import ConfigError, UsageError
from llmctl.perf.meter import StepMeter, step_load
from llmctl.serve.core.admission import RateMeter, expected_tokens
from llmctl.serve.core.block_manager import DROPPED, BlockManager
from llmctl.serve.core.policy import make_policy
from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.core.scheduler import ScheduledSeq, Scheduler
from llmctl.serve.core.sequence import Request, Sequence, SequenceStatus
from llmctl.serve.engine.config import EngineConfig, make_engine_config
from llmctl.serve.engine.detokenizer import IncrementalDetokenizer
from llmctl.serve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmctl.serve.engine.request_checks import check_request
from llmctl.serve.layers.kv_quant import kv_format
from llmctl.serve.lora.adapter import LoRAError, LoRARegistry
from llmctl.serve.model.decoder import LlamaModel, ModelSpec
from llmctl.serve.model.kv_cache import (
    KVCachePlan,
    allocate_kv_cache,
    allocate_kv_scales,
    available_memory,
    plan_kv_cache,
)
from llmctl.serve.model.runner import LogitRows, ModelRunner, PromptLogits
from llmctl.serve.sample.rejection_sampler import greedy_verify, rejection_sample
from llmctl.serve.sample.sampler import Sampler, generator_for, generator_snapshot
from llmctl.serve.sample.spec_decode import DraftModelProposer, NgramProposer
from llmctl.utils.dtypes import FLOAT_DTYPES, short_name, torch_dtype

log = logging.getLogger("llmctl.serve")


class _Built:
    """A model with its cache, block manager and runner (the target, or a draft model)."""

    def __init__(self, resolved, config: EngineConfig, device: torch.device, max_len: int,
                 num_blocks: int | None = None, with_lora: bool = False,
                 tokenizer=None) -> None:
        from llmctl.serve.model.weights import load_model

        path = resolved.path
        self.spec = ModelSpec.from_dir(path)
        name = config.dtype if config.dtype != "auto" else self.spec.torch_dtype
        dtype = torch_dtype(name) if name in FLOAT_DTYPES else torch.float32
        reader = None
        if _gguf_native(resolved, config):
            from llmctl.serve.model.gguf_weights import GGUFWeights

            reader = GGUFWeights(resolved.origin)
        self.model: LlamaModel = load_model(path, dtype=dtype, device=device,
                                            backend=config.quant_backend, max_len=max_len,
                                            spec=self.spec, reader=reader,
                                            lm_head=config.lm_head,
                                            bf16_gemm=config.bf16_gemm)
        fmt = kv_format(_kv_cache_dtype(config.kv_cache_dtype, path), dtype)
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


def _kv_cache_dtype(asked: str, path: Path) -> str:
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


def _gguf_native(resolved, config: EngineConfig) -> bool:
    """Whether a GGUF-derived model keeps its quantized tensors (see EngineConfig)."""
    if resolved.origin is None or config.quant_backend != "kernel":
        return False
    if config.gguf_weights == "auto":
        return resolved.source == "gguf"
    return config.gguf_weights == "quantized"


class _PromptAwareBlockManager(BlockManager):
    """A request collecting prompt log-probs must compute every prompt position: a
    cached prefix would skip them (vLLM's KV cache manager makes the same exception)."""

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        if seq.request.needs_prompt_logits:
            return []
        return super().find_cached_prefix(seq)


# The phases of step(), in order: taking queued requests in and choosing the batch
# (schedule), the model pass with KV-cache writes (forward), sampling (sample), appending
# tokens with detokenization, stop checks and block commits (update), and building the
# RequestOutputs (output).
STEP_PHASES = ("schedule", "forward", "sample", "update", "output")


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
        # blocks out of every layer's sliding window are released as sequences grow
        self.block_manager = _PromptAwareBlockManager(
            self.kv_plan.num_blocks, config.block_size, config.enable_prefix_caching,
            sliding_window=self.spec.kv_window)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   policy=make_policy(config), max_loras=config.max_loras)
        self.runner = self.target.runner
        self.loras = self._lora_registry(config)
        self.sampler = Sampler(config.seed)
        self.eos_token_ids = frozenset(self.spec.eos_token_ids or self._fallback_eos_ids())
        self.proposer = self._make_proposer(self.max_model_len)
        self._draft_probs: dict[int, torch.Tensor | None] = {}  # the proposer's q per step

        self._lock = threading.Lock()
        self._inbox: deque[tuple[str, object]] = deque()
        self._known_ids: set[str] = set()
        self.requests: dict[str, Request] = {}
        self._failed: list[Request] = []  # failed in this step, ended at its end
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "cached_prompt_tokens": 0,
                         "num_requests_finished": 0, "num_steps": 0, "spec_draft_tokens": 0,
                         "spec_accepted_tokens": 0, "spec_verify_steps": 0}
        # Wall seconds spent in each phase of step(), summed (STEP_PHASES): where a
        # step's time goes, offline and behind the server alike (/metrics).
        self.phase_seconds = dict.fromkeys(STEP_PHASES, 0.0)
        # FLOPs, bytes and seconds of every step by phase (llmctl.perf.meter): the MFU/MBU
        # counters and gauges of /metrics
        self.meter = StepMeter()
        self._step_cost = self._perf_cost()
        # tokens/s of recent saturated steps, output fraction: deadline admission's inputs
        self.rate_meter = RateMeter()
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

        resolved = resolve_model(config.model)
        self.model_path = resolved.path
        spec = ModelSpec.from_dir(self.model_path)
        self.max_model_len = self._check_max_len(config, spec.max_position_embeddings)
        self.tokenizer = load_tokenizer(resolve_model(config.tokenizer).path
                                        if config.tokenizer else self.model_path)
        self.target = _Built(resolved, config, self.device, self.max_model_len, with_lora=True,
                             tokenizer=self.tokenizer)

    def _perf_cost(self) -> tuple | None:
        """The cost model steps are metered with: FLOPs from the architecture in
        config.json, bytes from the weights as loaded (:attr:`LlamaModel.
        bytes_read_per_step`) and the KV cache's dtype. None for an architecture the cost
        model does not describe (the server then exports no utilization)."""
        import json

        from llmctl.perf.costs import ArchSpec, ModelCost

        try:
            config = json.loads((Path(self.model_path) / "config.json").read_text())
            spec = self.spec
            # per K/V element read, an 8-bit cache's scales included
            kv_bytes = self.kv_plan.bytes_per_block / (
                spec.num_layers * 2 * self.kv_plan.block_size * spec.num_kv_heads
                * spec.head_dim)
            cost = ModelCost(ArchSpec.from_config(config), kv_bytes=kv_bytes)
        except (OSError, ValueError, ConfigError) as exc:
            log.info("no FLOP/byte accounting for this model: %s", exc)
            return None
        return cost, float(self.target.model.bytes_read_per_step)

    def _lora_registry(self, config: EngineConfig) -> LoRARegistry | None:
        """The adapters served (``config.loras`` loaded now); None when the runner cannot
        apply any (an engine directory's runtime holds its own weights)."""
        model = getattr(self.target, "model", None)
        if not isinstance(model, LlamaModel):
            if config.loras:
                raise ConfigError("LoRA adapters run on the paged torch runner only; this "
                                  "engine directory cannot serve them",
                                  "serve the source checkpoint with --lora")
            return None
        # float32 adapters whatever the model's dtype (llmctl.serve.lora.batch)
        registry = LoRARegistry(self.spec, max_rank=config.max_lora_rank,
                                dtype=torch.float32, device=self.device)
        for name, path in config.loras.items():
            adapter = registry.load(name, path)
            log.info("LoRA adapter %r: rank %d, scale %g, %.1f MiB (%s)", name, adapter.rank,
                     adapter.scaling, adapter.nbytes / 2**20, path)
        return registry

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

        draft = _Built(resolve_model(spec_cfg.draft_model), self.config, self.device, max_len,
                       num_blocks=self.kv_plan.num_blocks, tokenizer=self.tokenizer)
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
                               prompt_logprobs=hasattr(self.runner, "execute_with_prompt"))
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
                    outputs.append(self._output(request, request.seqs))
                    self._retire(request)

    # --- failures: one request never hurts another (see the module docstring) ---------------
    @contextlib.contextmanager
    def _guard(self, request: Request) -> Iterator[None]:
        """Per-request work: an exception in the block fails ``request`` alone."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - whatever it was, it was this request's
            self._fail(request, exc)

    def _fail(self, request: Request, exc: BaseException) -> None:
        if request.error is not None:
            return
        log.error("request %r failed: %s: %s", request.request_id, type(exc).__name__, exc,
                  exc_info=exc)
        request.error = f"{type(exc).__name__}: {exc}"
        self._failed.append(request)

    def _isolated(self, fn: Callable[[list], list], units: list, seqs: list[Sequence],
                  on_fail: Callable[[Sequence, BaseException], None] | None = None) -> list:
        """``fn(units)``: batched work with one result per unit (``seqs[i]`` owns
        ``units[i]``). If it raises, each unit runs alone, with the seeded generators put
        back first so a unit draws what the batch would have drawn for it; a unit that
        raises alone gets ``on_fail`` (default: its request fails) and the result None."""
        on_fail = on_fail or (lambda seq, exc: self._fail(seq.request, exc))
        restore = generator_snapshot(seqs)
        try:
            return fn(units)
        except Exception as exc:  # noqa: BLE001 - attributed below
            if len(units) == 1:
                on_fail(seqs[0], exc)
                return [None]
            log.warning("a batch of %d failed (%s: %s); running each alone to find the cause",
                        len(units), type(exc).__name__, exc)
        restore()
        results = []
        for unit, seq in zip(units, seqs):
            try:
                results.append(fn([unit])[0])
            except Exception as exc:  # noqa: BLE001 - this unit's own failure
                on_fail(seq, exc)
                results.append(None)
        return results

    def _end_failed(self) -> list[RequestOutput]:
        """End each request that failed in this step: its unfinished sequences finish with
        "error" (blocks freed, nothing enters the prefix cache) and it gets its final output."""
        outputs = []
        failed, self._failed = self._failed, []
        for request in failed:
            if self.requests.get(request.request_id) is not request:
                continue  # already retired (aborted in the same step)
            request.seqs[0].pending_fork = 0
            for seq in request.seqs:
                if not seq.finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
                    if self.proposer is not None:
                        self.proposer.release(seq)
            outputs.append(self._output(request, []))
            self._retire(request)
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
        self.counters["num_steps"] += 1
        for item in scheduled:
            req = item.seq.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            if item.seq.num_computed_tokens < item.seq.num_prompt_tokens:
                self.counters["prompt_tokens"] += item.num_new_tokens
                if item.seq.first_token_time is None:  # a prefill chunk, for traces
                    req.prefill_chunks += ((now, item.num_new_tokens),)
        phases, mark = self.phase_seconds, time.perf_counter()
        self.runner.copy_blocks(copies)
        logits, rows, prompt = self._forward(scheduled)
        self._collect_prompt_logprobs(prompt)
        live = [item for item in scheduled if item.seq.request.error is None]
        for item in live:
            item.seq.num_computed_tokens += item.num_new_tokens - item.num_spec_tokens
        now = time.perf_counter()
        phases["forward"] += now - mark
        mark = now

        new_tokens = self._sample(logits, [r for r in rows if r.item.seq.request.error is None])
        now = time.perf_counter()
        phases["sample"] += now - mark
        mark = now
        touched: dict[str, list[Sequence]] = {}
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
        outputs = []
        for req_id, seqs in touched.items():
            request = self.requests[req_id]
            if request.error is not None:
                continue
            with self._guard(request):
                out = self._output(request, seqs)
                outputs.append(out)
                if request.finished:
                    self._retire(request)
        phases["output"] += time.perf_counter() - mark
        return outputs

    def _execute(self, items: list[ScheduledSeq]
                 ) -> tuple[torch.Tensor, list[LogitRows], list[PromptLogits]]:
        if any(item.seq.request.needs_prompt_logits for item in items):
            return self.runner.execute_with_prompt(items)
        logits, rows = self.runner.execute(items)
        return logits, rows, []

    def _forward(self, scheduled: list[ScheduledSeq]
                 ) -> tuple[torch.Tensor, list[LogitRows], list[PromptLogits]]:
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
        prompt: list[PromptLogits] = []
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

    def _collect_prompt_logprobs(self, parts: list[PromptLogits]) -> None:
        for part in parts:
            request = part.item.seq.request
            with self._guard(request):
                targets = request.prompt_token_ids[part.first:part.first + part.logits.shape[0]]
                entries = Sampler.logprobs(part.logits, targets,
                                           [request.params.prompt_logprobs] * len(targets))
                request.add_prompt_logprobs(part.first, entries)

    def _propose(self) -> None:
        seqs, limits = [], []
        for seq in self.scheduler.running:
            params = seq.params
            # constrained or biased sequences are not drafted for (see the module
            # docstring): draft verification compares against the unbiased logits
            if seq.num_uncomputed_tokens != 1 or params.needs_penalties or seq.pending_fork \
                    or seq.constraint is not None or params.logit_bias or seq.no_drafts:
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
            drawn = self._isolated(lambda units: self._draw(logits, units), plain, seqs)
            results.extend((seq, *out) for seq, out in zip(seqs, drawn) if out is not None)
        spec = [r for r in rows if r.count > 1]
        if spec:
            seqs = [r.item.seq for r in spec]
            verified = self._isolated(lambda units: self._verify(units, logits), spec, seqs)
            for r, seq, out in zip(spec, seqs, verified):
                seq.spec_token_ids = []
                if out is None:
                    continue
                tokens, lps = out
                accepted = len(tokens) - 1
                self.counters["spec_draft_tokens"] += r.item.num_spec_tokens
                self.counters["spec_accepted_tokens"] += accepted
                self.counters["spec_verify_steps"] += 1
                seq.num_computed_tokens += accepted
                results.append((seq, tokens, lps))
        return results

    def _draw(self, logits: torch.Tensor, units: list[tuple[int, Sequence]]
              ) -> list[tuple[list[int], list | None]]:
        """One token (and its logprobs when asked) per (logits row, sequence)."""
        index = [row for row, _ in units]
        seqs = [seq for _, seq in units]
        sub = logits if index == list(range(logits.shape[0])) else logits[index]
        tokens = self.sampler.sample(sub, seqs)
        top_n = [s.params.logprobs for s in seqs]
        lps = (Sampler.logprobs(sub, tokens, [n or 0 for n in top_n])
               if any(n is not None for n in top_n) else None)
        return [([tokens[i]], [lps[i]] if lps and top_n[i] is not None else None)
                for i in range(len(seqs))]

    def _verify(self, spec: list[LogitRows], logits: torch.Tensor
                ) -> list[tuple[list[int], list | None]]:
        """Accept or reject each sequence's draft tokens (one batched pass over the rows):
        the tokens to append and their logprobs. Changes no sequence (the caller does)."""
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
            lps = None
            if seq.params.logprobs is not None:
                lps = Sampler.logprobs(logits[r.start:r.start + len(tokens)], tokens,
                                       [seq.params.logprobs] * len(tokens))
            results.append((tokens, lps))
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
        if all(s.finish_reason in ("stop", "length") for s in request.seqs):
            self.rate_meter.record_finish(sum(s.num_output_tokens for s in request.seqs),
                                          request.params.max_tokens * request.params.n)
        self.counters["num_requests_finished"] += 1
        self.counters["cached_prompt_tokens"] += request.seqs[0].num_cached_tokens
        self.requests.pop(request.request_id, None)
        with self._lock:
            self._known_ids.discard(request.request_id)

    def _output(self, request: Request, changed: list[Sequence]) -> RequestOutput:
        outputs = []
        for seq in request.seqs:
            out_ids = seq.output_token_ids
            # a failed request's detokenizer may be what failed: its text is not read
            text = seq.detok.visible_text if request.error is None else ""
            outputs.append(CompletionOutput(
                index=seq.index, token_ids=list(out_ids), text=text,
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
            finished=request.finished, error=request.error,
            prompt_logprobs=None if prompt_lps is None else list(prompt_lps),
            metrics=RequestMetrics(
                arrival_time=request.arrival_time,
                first_scheduled_time=request.first_scheduled_time,
                first_token_time=min((s.first_token_time for s in request.seqs
                                      if s.first_token_time is not None), default=None),
                finish_time=time.time() if request.finished else None,
                num_cached_tokens=request.seqs[0].num_cached_tokens,
                prefill_chunks=request.prefill_chunks,
                preemption_times=request.preemption_times),
            tenant=request.tenant, priority_class=request.priority_class)

    # --- introspection -------------------------------------------------------------------------
    def admission_key(self, priority: int, priority_class: str | None) -> tuple:
        """Queued work whose key (``stats()["queued_work"]``: (key, tokens) pairs) is at
        most this one goes before a new request of this priority and class. Any thread."""
        return self.scheduler.policy.admission_key(priority, priority_class)

    def queue_key(self, priority_class: str | None) -> tuple:
        """The queue (``stats()["queued_requests"]``: (key, count) pairs) the server's
        queue limit counts for a new request of this class. Any thread."""
        return self.scheduler.policy.queue_key(priority_class)

    def wait_bound(self, priority_class: str | None) -> float | None:
        """Seconds a new request of this class waits at most, whatever is queued ahead
        (the fair policy's aging bound), or None. Any thread."""
        return self.scheduler.policy.wait_bound(priority_class)

    def _queued_work(self, fraction: float
                     ) -> tuple[list[tuple[tuple, float]], list[tuple[tuple, int]]]:
        """Tokens the waiting requests (and those added, not yet taken in) will still
        compute, by :meth:`admission_key` (:func:`llmctl.serve.core.admission.expected_tokens`),
        and how many they are, by :meth:`queue_key`."""
        with self._lock:
            added = [item for kind, item in self._inbox if kind == "add"]
        seqs = [*self.scheduler.waiting, *(request.seqs[0] for request in added)]
        policy = self.scheduler.policy
        work: dict[tuple, float] = {}
        count: dict[tuple, int] = {}
        for seq in seqs:
            req = seq.request
            key = policy.admission_key(req.priority, req.priority_class)
            output = (req.params.max_tokens - seq.num_output_tokens) * (1 + seq.pending_fork)
            work[key] = work.get(key, 0.0) + expected_tokens(seq.num_uncomputed_tokens, output,
                                                             fraction)
            queue = policy.queue_key(req.priority_class)
            count[queue] = count.get(queue, 0) + 1
        return sorted(work.items()), sorted(count.items())

    def stats(self) -> dict:
        bm = self.block_manager
        sched = self.scheduler
        allocated, used = self._kv_slots()
        c = self.counters
        drafts = c["spec_draft_tokens"]
        rate = self.rate_meter.estimate()
        work, count = self._queued_work(rate.output_fraction if rate else 1.0)
        return {
            "num_running": len(sched.running),
            # the scheduler's queue and the requests added but not yet taken in
            "num_waiting": sum(n for _, n in count),
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
            "step_phase_seconds": dict(self.phase_seconds),
            "perf_totals": {p: load for p, load in self.meter.totals.items()},
            "perf_recent": self.meter.recent(),
            # the dtype the matrix products run in -> the peak MFU is measured against
            # (int4/int8 weights are widened to the activation dtype, so theirs run in it too)
            "perf_dtype": short_name(getattr(getattr(self.target, "model", None), "dtype",
                                             None)) or "unknown",
            # deadline admission (llmctl.serve.core.admission): None until measured
            "admission_rate": rate,
            "queued_work": work,
            "queued_requests": count,  # the queue limit's input (AsyncEngine)
        }

    def _kv_slots(self) -> tuple[int, int]:
        """Slots in blocks held by running sequences, and how many of them hold a token."""
        filled: dict[int, int] = {}
        bs = self.block_manager.block_size
        for seq in self.scheduler.running:
            for i, block_id in enumerate(seq.block_table):
                if block_id == DROPPED:
                    continue
                n = min(bs, max(0, seq.num_computed_tokens - i * bs))
                if n > filled.get(block_id, -1):
                    filled[block_id] = n
        return len(filled) * bs, sum(filled.values())
