"""The eval pipeline: reference store -> candidate, window by window -> tasks -> report.

Memory stays bounded by one window: the reference's top-k rows are read back one
window at a time and each candidate window's logits are reduced to a few numbers
per token before the next window runs. What grows with the text is O(N) floats of
per-token statistics (kept for the percentiles) and, while the store is built,
O(N k) kept rows.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmctl.errors import ConfigError, LlmctlError
from llmctl.eval import routing
from llmctl.eval.candidates import (
    Candidate,
    CandidateOptions,
    HFCandidate,
    open_candidate,
)
from llmctl.eval.engine_candidates import ServeEngineCandidate
from llmctl.eval.memory import flat_heap
from llmctl.eval.metrics import (
    PositionStats,
    comparison_summary,
    perplexity_summary,
    position_stats,
)
from llmctl.eval.reference_store import ReferenceStore, build_store, load_store, store_key
from llmctl.eval.tasks import TaskResult, expand_task_names, load_task, score_task
from llmctl.eval.windows import Windowing, WindowPlan, plan_windows, resolve_bos

REPORT_SCHEMA = "llmctl.eval/1"
DEFAULT_DATA = "builtin:pydoc-heldout"


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    candidate: str
    reference: str | None = None
    data: str | None = DEFAULT_DATA
    field: str = "text"
    windowing: Windowing = Field(default_factory=Windowing)
    top_k: int = Field(64, ge=1)
    tasks: list[str] = Field(default_factory=list)
    task_dir: Path | None = None
    task_limit: int | None = Field(None, ge=1)
    reference_tasks: bool = True
    # generative tasks: the answer's token budget, and whether the template may think
    # (False: enable_thinking false, Qwen3's switch); reasoning is stripped either way
    task_max_tokens: int = Field(256, ge=1)
    thinking: bool = True
    seed: int = 0
    dtype: str = "float32"
    backend: str = "auto"
    # the serving engine's KV cache for the candidate (backend "serve"; its reference
    # keeps the model dtype's cache, so the two differ in the cache alone)
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "int8", "fp8",
                            "fp8_e4m3"] = "auto"
    server_model: str | None = None
    tokenizer: str | None = None
    threads: int | None = Field(None, ge=1)
    cache_dir: Path | None = None
    # score the reference again even when its cached store exists (`check --force reference`)
    rebuild_reference: bool = False

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if self.kv_cache_dtype != "auto" and self.backend != "serve":
            raise ValueError("--kv-cache-dtype (kv_cache_dtype) applies to the serving "
                             "engine: pass --backend serve")
        return self


class _Quiet:
    """The runner's view of the CLI's Output: status lines and progress bars."""

    def status(self, message: str) -> None:
        pass

    @contextlib.contextmanager
    def progress(self, description: str) -> Iterator[Callable[[int, int], None]]:
        yield lambda done, total: None


def default_cache_dir() -> Path:
    from llmctl.home import llmctl_home

    return llmctl_home() / "eval" / "reference"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(text).name or text).strip("-")[:40] or "model"


def _data_info(source, ids: list[int]) -> dict[str, Any]:
    return {"spec": source.spec, "sha256": source.sha256, "documents": len(source.texts),
            "characters": source.characters, "tokens": len(ids)}


def _tokenizer_info(tokenizer) -> dict[str, Any]:
    return {"class": type(tokenizer).__name__,
            "name_or_path": getattr(tokenizer, "name_or_path", None),
            "vocab_size": len(tokenizer) if hasattr(tokenizer, "__len__") else None}


def _plan(tokenizer, config: EvalConfig) -> tuple[WindowPlan, dict[str, Any]]:
    from llmctl.data.sources import load_text_source, token_stream

    source = load_text_source(config.data, config.field)
    ids = token_stream(tokenizer, source)
    plan = plan_windows(ids, config.windowing, resolve_bos(config.windowing, tokenizer))
    return plan, _data_info(source, ids)


def _windows_info(plan: WindowPlan, windowing: Windowing) -> dict[str, Any]:
    return {**windowing.model_dump(), "windows": len(plan.inputs), "bos_id": plan.bos_id,
            "scored_tokens": plan.scored_tokens, "stream_tokens": plan.stream_tokens}


# -- reference ------------------------------------------------------------------------


def is_store(spec: str) -> bool:
    return spec.endswith(".safetensors") and Path(spec).is_file()


def reference_candidate(config: EvalConfig) -> Candidate:
    """transformers at ``--dtype``; with ``--backend serve`` the serving engine with the
    model dtype's KV cache (the candidate differs in ``--kv-cache-dtype`` alone)."""
    options = CandidateOptions(dtype=config.dtype, threads=config.threads)
    if config.backend == "serve":
        return ServeEngineCandidate(config.reference, options)
    return HFCandidate(config.reference, options)


def prepare_reference(config: EvalConfig, ui) -> tuple[ReferenceStore, Any, Candidate | None]:
    """Load or build the reference store; returns it, the tokenizer and the (lazy) model."""
    spec = config.reference
    if is_store(spec):
        store = load_store(Path(spec))
        tokenizer = None
        model_path = store.meta.get("model", {}).get("path")
        if model_path and Path(model_path).is_dir():
            from llmctl.models.loading import load_tokenizer

            tokenizer = load_tokenizer(Path(model_path))
        return store, tokenizer, None
    reference = reference_candidate(config)
    plan, data = _plan(reference.tokenizer, config)
    described = reference.describe()
    key = store_key(described["sha256_quick"], data["sha256"], config.windowing.model_dump(),
                    config.top_k, plan.bos_id, dtype=config.dtype,
                    runtime=reference.kind if reference.kind != "hf" else None)
    path = (config.cache_dir or default_cache_dir()) / f"{_slug(spec)}-{key}.safetensors"
    if path.is_file() and not config.rebuild_reference:
        try:
            store = load_store(path)
            ui.status(f"reference: reusing {path}")
            store.reused = True
            return store, reference.tokenizer, reference
        except ConfigError as exc:
            ui.status(f"reference store unusable ({exc.message}); rebuilding")
    ui.status(f"reference: scoring {len(plan.inputs)} windows with {spec} (once; cached at {path})")
    meta = {"model": described, "data": data, "windowing": _windows_info(plan, config.windowing),
            "tokenizer": _tokenizer_info(reference.tokenizer), "dtype": config.dtype}
    with ui.progress("reference windows") as update:
        store = build_store(reference.logits, plan, config.top_k, path, meta, update)
    return store, reference.tokenizer, reference


def _check_same_vocabulary(candidate: Candidate, store: ReferenceStore, ref_tokenizer) -> None:
    vocab = store.meta.get("vocab_size")
    if vocab is not None and candidate.vocab_size != vocab:
        raise ConfigError(
            f"the candidate has {candidate.vocab_size} output tokens, the reference {vocab}",
            "KL divergence needs the same tokenizer; run without --reference for perplexity only")
    cand_tok = candidate.tokenizer
    if (ref_tokenizer is not None and cand_tok is not ref_tokenizer
            and hasattr(cand_tok, "get_vocab") and cand_tok.get_vocab() != ref_tokenizer.get_vocab()):
        raise ConfigError("the candidate's tokenizer differs from the reference's",
                          "KL divergence compares the same token ids; use the same tokenizer")


def compare_windows(candidate: Candidate, store: ReferenceStore,
                    update: Callable[[int, int], None]) -> tuple[PositionStats, list[dict]]:
    """Per-token statistics of the candidate against the stored reference.

    The output arrays are allocated once (see build_store on heap fragmentation).
    """
    plan = store.plan
    n = int(store.offsets[-1])
    out = PositionStats(*(np.empty(n) for _ in range(4)), np.empty(n, dtype=bool))
    per_window = []
    for w in range(store.windows):
        ref = store.window(w)
        cand = candidate.rows(plan.inputs[w], plan.rows[w], plan.targets(w), ref.top_ids)
        stats = position_stats(ref, cand)
        lo, hi = int(store.offsets[w]), int(store.offsets[w + 1])
        for name in ("nll", "nll_ref", "kld", "p_diff", "same_top"):
            getattr(out, name)[lo:hi] = getattr(stats, name)
        per_window.append({"tokens": hi - lo, "nll": float(stats.nll.mean()),
                           "ref_nll": float(stats.nll_ref.mean()),
                           "mean_kld": float(np.nanmean(stats.kld)) if hi > lo else None})
        del ref, cand, stats
        update(w + 1, store.windows)
    return out, per_window


def perplexity_windows(candidate: Candidate, plan: WindowPlan,
                       update: Callable[[int, int], None]) -> tuple[np.ndarray, list[dict]]:
    parts, per_window = [], []
    for w in range(len(plan.inputs)):
        rows = candidate.rows(plan.inputs[w], plan.rows[w], plan.targets(w))
        nll = -rows.target_logprob.astype(np.float64)
        parts.append(nll)
        per_window.append({"tokens": len(nll), "nll": float(nll.mean())})
        update(w + 1, len(plan.inputs))
    return np.concatenate(parts), per_window


# -- tasks ----------------------------------------------------------------------------


def run_tasks(candidate: Candidate, config: EvalConfig, ui, label: str) -> list[TaskResult]:
    names = expand_task_names(config.tasks)
    harness = [n.split(":", 1)[1] for n in names if n.startswith("lm_eval:")]
    results = []
    for name in (n for n in names if not n.startswith("lm_eval:")):
        task = load_task(name)
        with ui.progress(f"{label}: {task.name}") as update:
            results.append(score_task(candidate, task, config.task_limit, update,
                                      max_tokens=config.task_max_tokens,
                                      thinking=config.thinking))
    if harness:
        from llmctl.eval.lm_eval_bridge import run_lm_eval

        ui.status(f"{label}: lm-eval tasks {', '.join(harness)}")
        results.extend(run_lm_eval(candidate, harness, config.task_dir, limit=config.task_limit,
                                   seed=config.seed))
    return results


def _reference_tasks(reference: Candidate, config: EvalConfig, ui) -> list[TaskResult]:
    """The reference's task scores, cached next to its store (keyed like it)."""
    names = expand_task_names(config.tasks)
    hashes = [load_task(n).sha256 if not n.startswith("lm_eval:") else n for n in names]
    key = store_key(reference.describe()["sha256_quick"], json.dumps(hashes), {
        "limit": config.task_limit, "task_dir": str(config.task_dir),
        "max_tokens": config.task_max_tokens, "thinking": config.thinking}, 0, None,
        dtype=config.dtype)
    path = (config.cache_dir or default_cache_dir()) / f"tasks-{_slug(config.reference)}-{key}.json"
    if path.is_file():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return [TaskResult(**r) for r in json.loads(path.read_text())]
    results = run_tasks(reference, config, ui, "reference tasks")
    from llmctl.utils.atomic import write_text

    write_text(path, json.dumps([r.__dict__ for r in results]))
    return results


# -- the whole run --------------------------------------------------------------------


def _comparison_keys() -> set[str]:
    fake = PositionStats(*(np.zeros(12) for _ in range(4)), np.ones(12, dtype=bool))
    return set(comparison_summary(fake))


def comparison_only_metrics() -> set[str]:
    """Metrics that exist only when a reference is given."""
    return _comparison_keys() - set(perplexity_summary(np.zeros(2)))


def expected_metrics(config: EvalConfig) -> set[str]:
    """Metric names this configuration will produce (to reject gates before running)."""
    names: set[str] = set()
    if config.data:
        if config.reference:
            names.update(_comparison_keys())
            if _routing_compared(config):
                names.update(routing.METRICS)
        names.update(perplexity_summary(np.zeros(2)))
    from llmctl.eval.tasks import task_metric_name

    for name in expand_task_names(config.tasks):
        tm = task_metric_name(name)
        names.update(f"task.{tm}.{m}" for m in ("acc", "acc_se", "acc_norm", "acc_norm_se", "n"))
    return names


def _routing_compared(config: EvalConfig) -> bool:
    """Whether the run compares routing: a mixture-of-experts reference model (not a
    store) and a candidate run by transformers."""
    from llmctl.eval.candidates import OpenAIServerCandidate
    from llmctl.models.resolve import resolve_model

    if is_store(config.reference) or config.backend not in ("auto", "transformers") \
            or OpenAIServerCandidate.matches(config.candidate):
        return False
    try:
        return routing.experts_per_token(resolve_model(config.reference).path) is not None
    except LlmctlError:  # the run itself reports a reference it cannot find
        return False


def counted_metrics(config: EvalConfig) -> set[str]:
    """The proportions among ``expected_metrics``: the run reports how many items (or
    tokens) each was measured on, so Wilson bounds apply."""
    from llmctl.eval.tasks import task_metric_name

    names = {"same_top_p"} if config.data and config.reference else set()
    for name in expand_task_names(config.tasks):
        names.update(f"task.{task_metric_name(name)}.{m}" for m in ("acc", "acc_norm"))
    return names


def run_eval(config: EvalConfig, ui=None) -> dict[str, Any]:
    """The eval's report. Its windows run with glibc's mmap threshold pinned, and the
    process gets usable malloc settings back afterwards (:mod:`llmctl.eval.memory`)."""
    with flat_heap():
        return _run_eval(config, ui)


def _run_eval(config: EvalConfig, ui=None) -> dict[str, Any]:
    ui = ui or _Quiet()
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    run = _EvalRun(config, ui)
    run.run_reference()
    candidate = run.load_candidate()
    try:
        run.score_windows(candidate)
        run.compare_routing(candidate)
        run.candidate_tasks(candidate)
        described = candidate.describe()
    finally:
        candidate.close()
    return run.report(described)


@dataclass
class _EvalRun:
    """One eval's phases in order (reference, candidate windows, candidate tasks) and what
    they gather into the report."""

    config: EvalConfig
    ui: Any
    timings: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    reference_metrics: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    tasks: dict[str, Any] = field(default_factory=dict)
    reference_tasks: dict[str, Any] = field(default_factory=dict)  # per item: delta gates
    per_window: list[dict] = field(default_factory=list)
    store: ReferenceStore | None = None
    ref_tokenizer: Any = None
    data_info: dict[str, Any] | None = None
    windows_info: dict[str, Any] | None = None
    reference_routes: Any = None  # [moe layers, tokens, k] (llmctl.eval.routing)
    routing: dict[str, Any] = field(default_factory=dict)

    def run_reference(self) -> None:
        """The reference's store of windows and its tasks; its weights are freed before
        the candidate loads."""
        config, ui = self.config, self.ui
        reference = None
        if config.reference and config.data:
            start = time.perf_counter()
            self.store, self.ref_tokenizer, reference = prepare_reference(config, ui)
            self.timings["reference_s"] = round(time.perf_counter() - start, 2)
            self.reference_metrics.update(
                perplexity_summary(-self.store.target_logprobs().astype(np.float64)))
            self.data_info, self.windows_info = (self.store.meta["data"],
                                                 self.store.meta["windowing"])
        if config.reference and config.tasks and config.reference_tasks \
                and not is_store(config.reference):
            if reference is None:
                reference = reference_candidate(config)
            start = time.perf_counter()
            for result in _reference_tasks(reference, config, ui):
                self.reference_metrics.update(result.metrics())
                self.reference_tasks[result.name] = result.report_entry()
            self.timings["reference_tasks_s"] = round(time.perf_counter() - start, 2)
        if self.store is not None and isinstance(reference, HFCandidate) \
                and _routing_compared(config):
            start = time.perf_counter()
            self.reference_routes = routing.model_routes(
                reference.model, self.store.plan.inputs[:routing.ROUTING_WINDOWS],
                routing.experts_per_token(reference.path))
            self.timings["reference_routing_s"] = round(time.perf_counter() - start, 2)
        if reference is not None:
            reference.close()  # free its weights before the candidate loads

    def load_candidate(self) -> Candidate:
        """The candidate, with the reference's tokenizer (or ``--tokenizer``'s) for a
        server that has none of its own."""
        config = self.config
        tokenizer = self.ref_tokenizer
        if tokenizer is None and config.tokenizer:
            from llmctl.models.loading import load_tokenizer
            from llmctl.models.resolve import resolve_model

            tokenizer = load_tokenizer(resolve_model(config.tokenizer).path)
        return open_candidate(config.candidate, CandidateOptions(
            dtype=config.dtype, threads=config.threads, backend=config.backend,
            server_model=config.server_model, tokenizer=tokenizer,
            kv_cache_dtype=config.kv_cache_dtype))

    def score_windows(self, candidate: Candidate) -> None:
        """The candidate's windows: against the reference's store when there is one, else
        its perplexity alone."""
        config, ui, store = self.config, self.ui, self.store
        start = time.perf_counter()
        if store is not None:
            _check_same_vocabulary(candidate, store, self.ref_tokenizer)
            ui.status(f"candidate: {len(store.plan.inputs)} windows against the reference")
            with ui.progress("candidate windows") as update:
                stats, self.per_window = compare_windows(candidate, store, update)
            self.metrics.update(perplexity_summary(stats.nll))
            self.metrics.update(comparison_summary(stats))
            self.counts["same_top_p"] = len(stats.nll)
        elif config.data:
            plan, self.data_info = _plan(candidate.tokenizer, config)
            highest = max(max(w) for w in plan.inputs)
            if highest >= candidate.vocab_size:
                raise ConfigError(f"the tokenizer produced id {highest}, beyond the model's "
                                  f"{candidate.vocab_size} output tokens",
                                  "the checkpoint's tokenizer does not belong to its model")
            self.windows_info = _windows_info(plan, config.windowing)
            with ui.progress("candidate windows") as update:
                nll, self.per_window = perplexity_windows(candidate, plan, update)
            self.metrics.update(perplexity_summary(nll))
        self.timings["candidate_s"] = round(time.perf_counter() - start, 2)

    def compare_routing(self, candidate: Candidate) -> None:
        """Router agreement on the reference's first windows (llmctl.eval.routing)."""
        if self.reference_routes is None or not isinstance(candidate, HFCandidate):
            return
        k = routing.experts_per_token(candidate.path)
        windows = self.store.plan.inputs[:routing.ROUTING_WINDOWS]
        routes = routing.model_routes(candidate.model, windows, k) if k else None
        if routes is None or routes.shape != self.reference_routes.shape:
            raise ConfigError("the candidate's experts do not match the reference's "
                              "(MoE layers, experts per token)",
                              "compare a quantization of the reference model")
        per_layer = routing.agreement(self.reference_routes, routes)
        self.metrics.update(routing.summary(per_layer))
        self.routing = {"per_layer": [round(float(a), 6) for a in per_layer],
                        "tokens": int(routes.shape[1]), "windows": len(windows), "top_k": k}

    def candidate_tasks(self, candidate: Candidate) -> None:
        if not self.config.tasks:
            return
        start = time.perf_counter()
        for result in run_tasks(candidate, self.config, self.ui, "tasks"):
            self.metrics.update(result.metrics())
            self.counts.update(result.counts())
            self.tasks[result.name] = result.report_entry()
        self.timings["tasks_s"] = round(time.perf_counter() - start, 2)

    def report(self, described: dict[str, Any]) -> dict[str, Any]:
        from llmctl.report import run_metadata

        config, store = self.config, self.store
        reference_info = None
        if store is not None:
            reference_info = {**store.meta["model"], "store": str(store.path),
                              "store_reused": store.reused,
                              "top_k": store.top_k, "vocab_size": store.meta.get("vocab_size")}
        elif config.reference:
            reference_info = {"reference": config.reference}
        metadata = run_metadata(
            command="eval", candidate=described, reference=reference_info,
            data=self.data_info, windows=self.windows_info,
            top_k=store.top_k if store is not None else None,
            seed=config.seed, dtype=config.dtype, threads=config.threads,
            tasks=expand_task_names(config.tasks), task_limit=config.task_limit,
            definitions=DEFINITIONS)
        return {"schema": REPORT_SCHEMA, "metadata": metadata, "metrics": self.metrics,
                "reference_metrics": self.reference_metrics, "counts": self.counts,
                "tasks": self.tasks, "reference_tasks": self.reference_tasks,
                "routing": self.routing,
                "per_window": self.per_window, "timings_s": self.timings}


DEFINITIONS = {
    "ppl": "exp(mean NLL) over scored tokens (see windows); ppl_se = ppl * se(NLL), tokens "
           "treated as independent",
    "kld": "KL(P_ref || Q_cand) per token over the reference's top-k tokens plus one lumped "
           "tail bucket: a lower bound of the full-vocabulary KL",
    "dp": "p_cand(actual token) - p_ref(actual token), as a fraction (llama.cpp prints percent)",
    "same_top_p": "fraction of tokens where both models rank the same token first",
    "router_agreement": "per MoE layer, the fraction of tokens (first windows) whose top-k "
                        "expert set is the same in both models; _min over layers, _mean",
    "acc_norm": "argmax of log-likelihood / len(choice in characters), as lm-evaluation-harness",
}
