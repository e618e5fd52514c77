"""A whole ``llmctl bench`` invocation: set up the target, then for every sweep level
run the workload ``--repeat`` times and write one report (JSON, Markdown, CDF plot);
for a sweep also a summary with the throughput/latency trade-off plot.

A partial result is still a result: after Ctrl-C or a dead target the report of the
level in progress is written and the remaining levels are skipped.

``--find-capacity`` runs the levels the search (:mod:`llmctl.bench.capacity`) asks for
instead, each watched for over-saturation (:mod:`llmctl.bench.saturation`), and writes
one report: the knee's runs, with the whole search under its ``capacity`` key.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from llmctl.bench import plots
from llmctl.bench.backends import RequestSettings, get_backend
from llmctl.bench.compare import aggregate_repeats
from llmctl.bench.config import BenchOptions
from llmctl.bench.conversations import ttft_by_turn
from llmctl.bench.datasets import build_dataset, fingerprint
from llmctl.bench.launcher import LaunchedServer, free_port, server_command
from llmctl.bench.metrics import compute_metrics, raw_arrays
from llmctl.bench.records import SampleRequest
from llmctl.bench.report import (
    DEFINITIONS,
    SCHEMA,
    capacity_markdown,
    default_filename,
    markdown,
    rate_text,
    slug,
    sweep_markdown,
    timestamp,
    write_json,
)
from llmctl.bench.runner import RunPlan, RunResult, fill_output_tokens, probe, run_sync
from llmctl.bench.server_metrics import flat as server_flat
from llmctl.bench.target import ModelInfo, model_info
from llmctl.errors import MissingDependencyError, UsageError
from llmctl.utils.atomic import write_text
from llmctl.utils.cmdline import redact, redact_text, shown

SWEEP_ROW_KEYS = ("request_throughput", "output_throughput", "total_token_throughput",
                  "request_goodput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                  "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms",
                  "p99_e2el_ms", "completed", "failed")


@dataclass
class LevelResult:
    level: float | None
    report: dict
    path: Path


@dataclass
class SuiteResult:
    levels: list[LevelResult] = field(default_factory=list)
    sweep_path: Path | None = None
    capacity: dict | None = None  # the report's ``capacity`` section
    interrupted: bool = False
    target_down: str | None = None
    warnings: list[str] = field(default_factory=list)


@dataclass
class _Target:
    base_url: str
    served_model: str
    probe: dict
    launched: LaunchedServer | None
    command: list[str] | None


def _served_name(opts: BenchOptions, models: list[str]) -> str:
    if opts.served_model_name:
        return opts.served_model_name
    if opts.model and opts.model in models:
        return opts.model
    if len(models) == 1:
        return models[0]  # one model served: whatever it is called, that is the one
    return opts.model or ""


def _launch_command(opts: BenchOptions, port: int, out) -> list[str]:
    """The server command; llmctl's own serve gets the dtype resolved here, so the
    report's command line says which one ran."""
    if opts.server_command:
        return server_command(opts.model or "", port, opts.server_command)
    if any(a.split("=")[0] == "--dtype" for a in shlex.split(opts.serve_args or "")):
        if opts.dtype != "auto":
            raise UsageError("--dtype given twice (also in --serve-args)", "pass it once")
        return server_command(opts.model or "", port, None, opts.serve_args)
    from llmctl.models.resolve import checkpoint_dtype
    from llmctl.utils.device import default_device, resolve_dtype

    choice = resolve_dtype(opts.dtype, device=default_device(),
                           model_dtype=lambda: checkpoint_dtype(opts.model or ""))
    out.status(f"server {choice.describe()}")
    return server_command(opts.model or "", port, None,
                          shlex.join(["--dtype", choice.dtype]) + " " + (opts.serve_args or ""))


def _start_target(opts: BenchOptions, stack: contextlib.ExitStack, out,
                  api_key: str | None) -> _Target:
    launched = command = None
    if opts.target:
        base_url = opts.target.rstrip("/")
    else:
        port = free_port()
        command = _launch_command(opts, port, out)
        base_url = f"http://127.0.0.1:{port}"
        out.status(f"starting the server: {shown(command)}")
        launched = stack.enter_context(LaunchedServer(command, base_url,
                                                      timeout=opts.server_timeout))
        out.status(f"server ready after {launched.startup_seconds:.1f} s")
    info = asyncio.run(probe(base_url, api_key))
    return _Target(base_url, _served_name(opts, info["models"]), info, launched, command)


def _level_options(opts: BenchOptions, level: float | None) -> tuple[float, int | None]:
    rate, concurrency = opts.request_rate, opts.max_concurrency
    if opts.sweep is not None and level is not None:
        if opts.sweep.param == "rate":
            rate = level
        else:
            concurrency = int(level)
    return rate, concurrency


def _report(opts: BenchOptions, runs: list[RunResult], *, rate: float,
            concurrency: int | None, target: _Target, info: ModelInfo,
            samples: list[SampleRequest], load_start: list[float] | None) -> dict:
    from llmctl.report import run_metadata

    per_run = []
    for result in runs:
        metrics = compute_metrics(result.records, result.duration, opts.percentiles, opts.slos)
        metrics.update(server_flat(result.server_summary))
        per_run.append(metrics)
    last = runs[-1]
    flat = per_run[0] if len(runs) == 1 else aggregate_repeats(per_run)["median"]
    arrays: dict[str, list] = {}
    for result in runs:
        for key, values in raw_arrays(result.records).items():
            arrays.setdefault(key, []).extend(values)
    engine = {"launched": target.launched is not None,
              "command": redact(target.command) if target.command else None,
              "serve_args": redact_text(opts.serve_args), "target": target.base_url,
              "server_header": target.probe.get("server"),
              "served_models": target.probe.get("models"),
              "startup_seconds": target.launched.startup_seconds if target.launched else None}
    by_turn = ttft_by_turn([r for result in runs for r in result.records])
    if by_turn:  # a multi-turn workload: TTFT as the history grows
        arrays["ttft_by_turn"] = by_turn
    dataset = {**opts.dataset.model_dump(), "fingerprint": fingerprint(samples),
               "mean_prompt_len": sum(s.prompt_len for s in samples) / len(samples),
               "mean_output_len": sum(s.output_len for s in samples) / len(samples)}
    report = {
        "schema": SCHEMA,
        "date": timestamp(),
        "label": opts.run_label,
        "backend": opts.backend,
        "endpoint": opts.endpoint or get_backend(opts.backend).path,
        "target": target.base_url,
        "model_id": target.served_model,
        "tokenizer_id": info.tokenizer_id,
        "num_prompts": len(samples),
        "request_rate": rate_text(rate) if math.isinf(rate) else rate,
        "burstiness": "inf" if math.isinf(opts.burstiness) else opts.burstiness,
        "max_concurrency": concurrency,
        "warmup": opts.warmup,
        "duration_limit": opts.duration,
        "ignore_eos": opts.ignore_eos,
        "seed": opts.dataset.seed,
        "dataset": dataset,
        "percentiles": opts.percentiles,
        "slos": opts.slos,
        "interrupted": any(r.interrupted for r in runs),
        "target_down": last.target_down,
        "not_sent": sum(r.not_sent for r in runs),
        "warmup_failed": sum(r.warmup_failed for r in runs),
        "load_average_start": load_start,
        **flat,
        "server_metrics": last.server_summary,
        "definitions": DEFINITIONS,
        "config": opts.model_dump(mode="json"),
        "metadata": run_metadata(model=info.to_dict(), engine=engine, dataset=dataset,
                                 seed=opts.dataset.seed),
        **arrays,
    }
    if len(runs) > 1:
        report["repeat"] = {**aggregate_repeats(per_run), "runs": per_run}
    report.update(_diagnosis(opts, last, flat, info))
    return report


def _diagnosis(opts: BenchOptions, run: RunResult, flat: dict, info: ModelInfo) -> dict:
    """MFU/MBU per phase, the verdicts and the cost (:mod:`llmctl.bench.diagnosis`) of the
    last run of a level; their flat keys beside the latency metrics, for gates."""
    from llmctl.bench.diagnosis import PerfSettings, diagnose

    sections = diagnose(
        PerfSettings(opts.hardware, opts.peak_flops, opts.peak_bandwidth, opts.cost_per_hour),
        model_path=info.path, dtype=opts.dtype, records=run.records, duration=run.duration,
        server_summary=run.server_summary, flat=flat, slos=opts.slos,
        shared_prefix_tokens=opts.dataset.prefix_len if opts.dataset.name == "prefix" else 0)
    return {**sections.pop("flat", {}), **sections}


def _paths(opts: BenchOptions, rate: float, concurrency: int | None, model: str,
           when: str, level: float | None) -> Path:
    directory = Path(opts.result_dir).expanduser()
    if opts.result_filename:
        name = Path(opts.result_filename)
        if level is not None and opts.sweep is not None:
            name = name.with_name(f"{name.stem}-{opts.sweep.param}{opts.sweep.label(level)}"
                                  f"{name.suffix or '.json'}")
        return name if name.is_absolute() else directory / name
    return directory / default_filename(opts.run_label, rate, concurrency, model, when)


def _measure(plan: RunPlan, backend, settings: RequestSettings, alive, count, out, what: str,
             watcher=None) -> RunResult:
    out.status(f"benchmarking {settings.base_url} ({what})")
    with out.progress("requests") as update:
        run = run_sync(plan, backend, settings, alive=alive, progress=update, watcher=watcher)
    fill_output_tokens(run.records, count)
    return run


def _load_average() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _plot(fn, *args, warnings: list[str]) -> None:
    try:
        fn(*args)
    except MissingDependencyError as exc:
        if str(exc) not in warnings:
            warnings.append(str(exc))


def run_suite(opts: BenchOptions, out, *, command: str, api_key: str | None = None
              ) -> SuiteResult:
    backend = get_backend(opts.backend)
    if not opts.target and not opts.model and not opts.server_command:
        raise UsageError("nothing to benchmark",
                         "pass --target URL of a running server, or --model MODEL to start "
                         "llmctl's own server for the run")
    if opts.dtype != "auto" and (opts.target or opts.server_command):
        raise UsageError("--dtype sets the dtype of the llmctl serve that bench starts",
                         "with --target or --server-command, give the dtype to that server")
    info = model_info(opts.model, opts.tokenizer)
    out.status(f"building the {opts.dataset.name} workload ({opts.dataset.num_prompts} prompts)")
    samples = build_dataset(opts.dataset, info.tokenizer)
    tok = info.tokenizer
    count = (lambda text: len(tok(text, add_special_tokens=False)["input_ids"])) if tok else None
    result = SuiteResult()
    when = timestamp()
    with contextlib.ExitStack() as stack:
        target = _start_target(opts, stack, out, api_key)
        settings = RequestSettings(target.base_url, target.served_model, opts.endpoint, api_key,
                                   opts.ignore_eos, opts.temperature)
        alive = target.launched.alive if target.launched else None
        if opts.capacity is not None:
            return _find_capacity(opts, out, command, when, result, samples, info, target,
                                  lambda plan, what, watcher: _measure(
                                      plan, backend, settings, alive, count, out, what,
                                      watcher))
        levels = opts.sweep.levels if opts.sweep else [None]
        for level in levels:
            rate, concurrency = _level_options(opts, level)
            plan = RunPlan(samples, request_rate=rate, burstiness=opts.burstiness,
                           max_concurrency=concurrency, warmup=opts.warmup,
                           duration=opts.duration, seed=opts.dataset.seed,
                           request_timeout=opts.request_timeout,
                           metrics_interval=opts.metrics_interval)
            load_start = _load_average()
            runs: list[RunResult] = []
            for repeat in range(opts.repeat):
                what = f"rate {rate_text(rate)}, concurrency {concurrency or 'inf'}" + (
                    f", run {repeat + 1}/{opts.repeat}" if opts.repeat > 1 else "")
                run = _measure(plan, backend, settings, alive, count, out, what)
                runs.append(run)
                if run.interrupted or run.target_down:
                    break
            report = _report(opts, runs, rate=rate, concurrency=concurrency, target=target,
                             info=info, samples=samples, load_start=load_start)
            path = write_json(_paths(opts, rate, concurrency, target.served_model or
                                     opts.model or "model", when, level), report)
            write_text(path.with_suffix(".md"), markdown(report, command))
            if opts.plots:
                _plot(plots.latency_cdfs, report, path.with_name(path.stem + "-cdf.png"),
                      warnings=result.warnings)
            result.levels.append(LevelResult(level, report, path))
            result.interrupted = report["interrupted"]
            result.target_down = report["target_down"]
            if result.interrupted or result.target_down:
                break
    if opts.sweep is not None and result.levels:
        result.sweep_path = _write_sweep(opts, result, command, when, target.served_model)
    return result


def sweep_rows(opts: BenchOptions, levels: list[LevelResult]) -> list[dict]:
    return [{"level": opts.sweep.label(lv.level), **{k: lv.report.get(k) for k in SWEEP_ROW_KEYS},
             "report": lv.path.name} for lv in levels]


def _write_sweep(opts: BenchOptions, result: SuiteResult, command: str, when: str,
                 model: str) -> Path:
    from llmctl.report import run_metadata

    rows = sweep_rows(opts, result.levels)
    directory = result.levels[0].path.parent
    path = directory / (f"{slug(opts.run_label)}-sweep-{opts.sweep.param}-"
                        f"{slug(model or opts.model or 'model')}-{when}.json")
    write_json(path, {"schema": "llmctl-bench-sweep/1", "param": opts.sweep.param,
                      "levels": [r["level"] for r in rows], "slos": opts.slos, "rows": rows,
                      "interrupted": result.interrupted, "target_down": result.target_down,
                      "metadata": run_metadata()})
    write_text(path.with_suffix(".md"), sweep_markdown(opts.sweep.param, rows, command))
    if opts.plots:
        _plot(plots.sweep_tradeoff, opts.sweep.param, rows, opts.slos,
              path.with_name(path.stem + ".png"), warnings=result.warnings)
    return path



@dataclass
class _LevelRun:
    """One run of the capacity search (its ``Outcome``: ``passed``, ``aborted``)."""

    level: float
    attempt: int
    seed: int
    rate: float
    concurrency: int | None
    run: RunResult
    metrics: dict
    checks: list
    watcher: object | None

    @property
    def aborted(self) -> bool:
        return self.run.interrupted or bool(self.run.target_down)

    @property
    def passed(self) -> bool:
        return (not self.aborted and self.run.stopped is None and self.metrics["completed"] > 0
                and all(c.passed for c in self.checks))


def _ttft_scale(bounds) -> float:
    """Seconds of TTFT that count as "large" for the over-saturation detector: the
    tightest TTFT bound, else the tightest E2E bound (TTFT is part of it), else 1 s."""
    for metric in ("ttft", "e2el"):
        limits = [b.limit_ms for b in bounds if b.metric == metric]
        if limits:
            return min(limits) / 1000.0
    return 1.0


CAPACITY_ROW_KEYS = ("duration", "num_requests", "completed", "failed", "request_throughput",
                     "output_throughput", "request_goodput")


def _capacity_row(probe, bounds) -> dict:
    lr: _LevelRun = probe.outcome
    finding = getattr(getattr(lr.watcher, "detector", None), "finding", None)
    m = lr.metrics
    return {"level": probe.level, "attempt": probe.attempt, "phase": probe.phase,
            "seed": lr.seed, "request_rate": rate_text(lr.rate) if math.isinf(lr.rate)
            else lr.rate, "max_concurrency": lr.concurrency, "passed": lr.passed,
            "over_saturated": lr.run.stopped is not None, "stopped_early": lr.run.stopped,
            "saturation": finding.to_dict() if finding else None,
            **{k: m.get(k) for k in CAPACITY_ROW_KEYS},
            **{b.key: m.get(b.key) for b in bounds},
            "slo_checks": [c.to_dict() for c in lr.checks]}


def _find_capacity(opts: BenchOptions, out, command: str, when: str, result: SuiteResult,
                   samples: list[SampleRequest], info: ModelInfo, target: _Target,
                   measure) -> SuiteResult:
    """Run the search, then write the knee's report (its runs, as repeats) with the
    search under ``capacity``; with no knee, the report of the last level run."""
    from llmctl.bench.capacity import STOPS, level_seed, search
    from llmctl.bench.saturation import SaturationDetector, SaturationWatch
    from llmctl.bench.slo import check_level

    spec = opts.capacity
    space, bounds = spec.space(), spec.bounds()
    scale = _ttft_scale(bounds)
    load_start = _load_average()
    out.status(f"searching the highest {spec.by} meeting {', '.join(spec.slo)} "
               f"(from {spec.start:g}, at most {spec.maximum:g}, resolution {spec.resolution})")

    def run_level(level: float, attempt: int) -> _LevelRun:
        rate, concurrency = ((level, opts.max_concurrency) if spec.by == "rate"
                             else (opts.request_rate, int(level)))
        seed = level_seed(opts.dataset.seed, level, attempt)
        plan = RunPlan(samples, request_rate=rate, burstiness=opts.burstiness,
                       max_concurrency=concurrency, warmup=opts.warmup, duration=opts.duration,
                       seed=seed, request_timeout=opts.request_timeout,
                       metrics_interval=opts.metrics_interval)
        planned = opts.duration or (len(samples) / rate if spec.by == "rate" else None)
        watcher = SaturationWatch(SaturationDetector(scale, planned)) if spec.early_stop \
            else None
        what = (f"capacity search: rate {rate_text(rate)}, concurrency {concurrency or 'inf'}"
                + (f", repeat {attempt}" if attempt else ""))
        run = measure(plan, what, watcher)
        metrics = compute_metrics(run.records, run.duration, opts.percentiles, opts.slos)
        metrics.update(server_flat(run.server_summary))
        lr = _LevelRun(level, attempt, seed, rate, concurrency, run, metrics,
                       check_level(bounds, run.records, metrics), watcher)
        verdict = "pass" if lr.passed else (run.stopped or "fail: " + ", ".join(
            f"{c.bound.key} {_fmt_ms(c.value_ms)}" for c in lr.checks if not c.passed))
        out.status(f"{spec.by} {level:g}: {verdict}")
        return lr

    found = search(space, run_level)
    shown_level = found.knee if found.knee is not None else found.probes[-1].level
    runs = [p.outcome.run for p in found.probes if p.level == shown_level]
    last: _LevelRun = found.probes[-1].outcome
    knee_runs = [p.outcome for p in found.probes if p.level == found.knee]
    section = {
        "by": spec.by, "slo": spec.slo, "start": spec.start, "maximum": spec.maximum,
        "resolution": spec.resolution, "confirm": spec.confirm, "early_stop": spec.early_stop,
        "knee": found.knee, "confirmed": found.confirmed, "stop": found.stop,
        "stop_reason": STOPS[found.stop], "bracket": list(found.bracket),
        # The lowest over the knee's runs: the goodput it held every time.
        "goodput_at_knee": min((lr.metrics["request_goodput"] for lr in knee_runs),
                               default=None),
        "throughput_at_knee": min((lr.metrics["request_throughput"] for lr in knee_runs),
                                  default=None),
        "verdict_at_knee": None,  # the knee's report's verdicts, below
        "levels": [_capacity_row(p, bounds) for p in found.probes],
        "curve": None,
    }
    shown: _LevelRun = next(p.outcome for p in found.probes if p.level == shown_level)
    report = _report(opts, runs, rate=shown.rate, concurrency=shown.concurrency, target=target,
                     info=info, samples=samples, load_start=load_start)
    if found.knee is not None:
        section["verdict_at_knee"] = report.get("verdicts")
    report.update({"capacity": section, "capacity_knee": found.knee,
                   "capacity_goodput_at_knee": section["goodput_at_knee"]})
    model = target.served_model or opts.model or "model"
    path = _capacity_path(opts, model, when)
    if opts.plots:
        curve = path.with_name(path.stem + "-capacity.png")
        _plot(plots.capacity_curve, section, bounds, curve, warnings=result.warnings)
        section["curve"] = curve.name if curve.exists() else None
        _plot(plots.latency_cdfs, report, path.with_name(path.stem + "-cdf.png"),
              warnings=result.warnings)
    write_json(path, report)
    write_text(path.with_suffix(".md"), markdown(report, command) + capacity_markdown(section))
    result.levels.append(LevelResult(shown_level, report, path))
    result.capacity = section
    result.interrupted = last.run.interrupted
    result.target_down = last.run.target_down
    return result


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _capacity_path(opts: BenchOptions, model: str, when: str) -> Path:
    directory = Path(opts.result_dir).expanduser()
    if opts.result_filename:
        name = Path(opts.result_filename)
        return name if name.is_absolute() else directory / name
    return directory / (f"{slug(opts.run_label)}-capacity-{opts.capacity.by}-{slug(model)}-"
                        f"{when}.json")
