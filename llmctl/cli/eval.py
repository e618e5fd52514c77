"""``llmctl eval``: perplexity, KL divergence, task accuracy and quality gates for CI.

    llmctl eval CANDIDATE [--reference MODEL] [--data SOURCE] [--tasks ...] [--gate ...]
    llmctl eval ENGINE_DIR --reference SOURCE_MODEL     # a built engine vs its source
    llmctl eval compare A.json B.json [...]

Exit codes: 0 all gates passed (or none given); 1 a gate failed, or the run failed;
2 the command line or a gate is malformed, or a gate names a metric this run does
not produce (a misconfigured CI job, not a quality regression).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmctl.cli.errors import guarded, usage_errors
from llmctl.cli.options import JsonOpt, KvCacheDtypeOpt

EXIT_GATE_FAILED = 1


Opt = typer.Option
Candidate = Annotated[str, typer.Argument(
    show_default=False,
    help="Model to evaluate: HF/compressed-tensors dir, .gguf, 'smollm2-135m', hub id, "
         "an engine directory from `llmctl build-engine` (ONNX / torch-compile; "
         "also engine:DIR), or openai:http://HOST:PORT (a server). Or 'compare' "
         "followed by report files.")]
More = Annotated[list[str] | None, typer.Argument(
    show_default=False, help="With 'compare': the eval reports (JSON) to compare.")]
Reference = Annotated[str | None, Opt("--reference", "-r",
                                      help="Reference model (or a stored reference "
                                           ".safetensors).")]
Data = Annotated[str, Opt("--data", "-d", help="Text for perplexity/KLD: .txt/.jsonl/.parquet, "
                                               "hf:NAME, builtin:pydoc-heldout, or 'none'.")]
Field = Annotated[str, Opt("--field", help="Text field of .jsonl/.parquet/hf data.")]
Ctx = Annotated[int, Opt("--ctx", help="Tokens per window.")]
Stride = Annotated[int | None, Opt("--stride", help="Window step (< ctx overlaps; default ctx).")]
Bos = Annotated[str, Opt("--bos", help="auto (as the tokenizer) | always | never.")]
ScoreFrom = Annotated[int, Opt("--score-from",
                               help="Score only tokens at index >= N in each window "
                                    "(ctx/2 mimics llama-perplexity).")]
MaxWindows = Annotated[int | None, Opt("--max-windows", help="Use at most N windows.")]
TopK = Annotated[int, Opt("--top-k", help="Reference log-probs kept per token.")]
Tasks = Annotated[list[str] | None, Opt(
    "--tasks", help="builtin | python-mc,science-mc,everyday-mc | arith-gen (generative) | "
                    "FILE.jsonl | lm_eval:NAME (repeatable, comma-separated).")]
TaskDir = Annotated[Path | None, Opt("--task-dir",
                                     help="lm-eval task YAML directory (include path).")]
TaskLimit = Annotated[int | None, Opt("--task-limit", help="Items per task.")]
TaskMaxTokens = Annotated[int, Opt("--task-max-tokens", min=1,
                                   help="Generative tasks: the answer's token budget "
                                        "(reasoning included).")]
Thinking = Annotated[bool, Opt("--thinking/--no-thinking",
                               help="Generative tasks: let a reasoning model think (its "
                                    "reasoning is stripped before scoring), or switch "
                                    "thinking off in its template (enable_thinking false).")]
Gate = Annotated[list[str] | None, Opt(
    "--gate", help="e.g. 'ppl_ratio<=1.05', 'mean_kld<=0.05', "
                   "'delta(task.science-mc.acc)>=-0.05' (paired vs the "
                   "reference), 'wilson_low(task.science-mc.acc)>=0.6' "
                   "(repeatable).")]
GateFile = Annotated[Path | None, Opt("--gate-file", help="YAML with gates: [...]")]
Baseline = Annotated[Path | None, Opt(
    "--baseline", help="Eval report whose metrics (and per-item task results, "
                       "for delta gates) are the 'reference' in gates.")]
Junit = Annotated[Path | None, Opt("--junit", help="Write gate results as JUnit XML.")]
ReportPath = Annotated[Path | None, Opt("--output", "-o",
                                    help="Report JSON (Markdown written next to it).")]
CacheDir = Annotated[Path | None, Opt("--cache-dir", help="Reference store directory.")]
Dtype = Annotated[str, Opt("--dtype", help="float32 | bfloat16 | float16.")]
Backend = Annotated[str, Opt(
    "--backend", help="auto | transformers | llama-cpp (for .gguf) | serve "
                      "(candidate and reference through llmctl's serving "
                      "engine: its kernels and KV cache).")]
ServerModel = Annotated[str | None, Opt("--server-model", help="Model name on the server.")]
Tokenizer = Annotated[str | None, Opt("--tokenizer",
                                      help="Tokenizer for a server without --reference.")]
Threads = Annotated[int | None, Opt("--threads", min=1,
                                    help="torch / llama.cpp / engine runtime threads.")]
Seed = Annotated[int, Opt("--seed", help="Seed (lm-eval sampling; recorded).")]
NoReferenceTasks = Annotated[bool, Opt("--no-reference-tasks",
                                       help="Do not run tasks on the reference model.")]
AllMetrics = Annotated[bool, Opt("--all", help="compare: every metric.")]


def register(app: typer.Typer) -> None:
    app.command("eval")(guarded(eval_))


def eval_(
    candidate: Candidate,
    more: More = None,
    reference: Reference = None,
    data: Data = "builtin:pydoc-heldout",
    field: Field = "text",
    ctx: Ctx = 512,
    stride: Stride = None,
    bos: Bos = "auto",
    score_from: ScoreFrom = 0,
    max_windows: MaxWindows = None,
    top_k: TopK = 64,
    tasks: Tasks = None,
    task_dir: TaskDir = None,
    task_limit: TaskLimit = None,
    task_max_tokens: TaskMaxTokens = 256,
    thinking: Thinking = True,
    gate: Gate = None,
    gate_file: GateFile = None,
    baseline: Baseline = None,
    junit: Junit = None,
    output: ReportPath = None,
    cache_dir: CacheDir = None,
    dtype: Dtype = "float32",
    backend: Backend = "auto",
    kv_cache_dtype: KvCacheDtypeOpt = "auto",
    server_model: ServerModel = None,
    tokenizer: Tokenizer = None,
    threads: Threads = None,
    seed: Seed = 0,
    no_reference_tasks: NoReferenceTasks = False,
    all_metrics: AllMetrics = False,
    json_: JsonOpt = False,
) -> None:
    """Measure quality against a reference and gate on regressions.

    Exit codes: 0 gates passed, 1 a gate failed (or the run failed), 2 a malformed
    command line or gate, or a gate on a metric this run does not produce.
    """
    from llmctl.cli.output import Output

    out = Output(json_)
    if candidate == "compare":
        _compare(out, more or [], all_metrics)
        return
    if more:
        from llmctl.errors import UsageError

        raise UsageError(f"unexpected arguments: {' '.join(more)}",
                         "pass one CANDIDATE (or 'compare A.json B.json')")
    _evaluate(out, locals())  # every option above, by name


def _build_config(args: dict):
    """The typed config; a value it refuses is reported as the option that set it."""
    from llmctl.eval.runner import EvalConfig
    from llmctl.eval.windows import Windowing

    windowing = Windowing(ctx=args["ctx"], stride=args["stride"], bos=args["bos"],
                          score_from=args["score_from"], max_windows=args["max_windows"])
    return EvalConfig(
        candidate=args["candidate"], reference=args["reference"],
        data=None if args["data"] in ("none", "") else args["data"], field=args["field"],
        windowing=windowing, top_k=args["top_k"], tasks=args["tasks"] or [],
        task_dir=args["task_dir"], task_limit=args["task_limit"],
        task_max_tokens=args["task_max_tokens"], thinking=args["thinking"],
        reference_tasks=not args["no_reference_tasks"] and args["baseline"] is None,
        seed=args["seed"], dtype=args["dtype"], backend=args["backend"],
        kv_cache_dtype=args["kv_cache_dtype"],
        server_model=args["server_model"], tokenizer=args["tokenizer"],
        threads=args["threads"], cache_dir=args["cache_dir"])


def _missing_metric_hint(metric: str, config) -> str:
    from llmctl.eval.runner import comparison_only_metrics

    if metric.startswith("task."):
        return "task metrics need --tasks NAME (task.NAME.acc, task.NAME.acc_norm)"
    if not config.data:
        return "perplexity and KLD metrics need --data SOURCE"
    if metric in comparison_only_metrics() and not config.reference:
        return "comparison metrics (KLD, ppl_ratio, same_top_p, ...) need --reference MODEL"
    return "check the metric name"


def _check_gates(gates, config, baseline, baseline_path) -> None:
    """Reject, before anything runs, gates this run cannot judge (usage errors, exit 2)."""
    from llmctl.errors import UsageError
    from llmctl.eval.runner import counted_metrics, expected_metrics

    produced = expected_metrics(config)
    for g in gates:
        if g.metric not in produced:
            raise UsageError(f"gate {g.text!r}: this run produces no metric {g.metric!r}",
                             f"{_missing_metric_hint(g.metric, config)}; metrics of this run: "
                             f"{', '.join(sorted(produced)[:12]) or 'none'}, ...")
        if g.form == "delta":
            _check_delta(g, config, baseline, baseline_path)
            continue
        if g.side() is not None and g.metric not in counted_metrics(config):
            raise UsageError(f"gate {g.text!r}: Wilson bounds apply to proportions measured "
                             f"on N items, and {g.metric} is not one",
                             "proportions of this run: "
                             + (", ".join(sorted(counted_metrics(config))) or "none"))
        if g.relative and baseline is None and not config.reference:
            raise UsageError(f"gate {g.text!r} compares with a reference value",
                             "pass --reference MODEL or --baseline REPORT.json")


def _baseline_remedy(path) -> str:
    return (f"regenerate {path} with this version (llmctl eval REFERENCE_MODEL --tasks ... "
            "-o FILE.json), or pass --reference MODEL instead of --baseline")


def _check_delta(gate, config, baseline, baseline_path) -> None:
    """A paired gate needs per-item results of the candidate and of its reference."""
    from llmctl.errors import UsageError
    from llmctl.eval.paired import outcomes, split_metric
    from llmctl.eval.runner import is_store
    from llmctl.eval.tasks import expand_task_names, task_metric_name

    parts = split_metric(gate.metric)
    if parts is None:
        raise UsageError(f"gate {gate.text!r}: delta(...) pairs per-item task results",
                         "use it on task.NAME.acc or task.NAME.acc_norm")
    task, kind = parts
    harness = {task_metric_name(n) for n in expand_task_names(config.tasks)
               if n.startswith("lm_eval:")}
    if task in harness:
        raise UsageError(f"gate {gate.text!r}: lm-eval tasks report aggregates, not items",
                         "gate lm-eval tasks with wilson_low(...) or run the items as a "
                         "JSONL task (--tasks FILE.jsonl)")
    if baseline is not None:
        if outcomes((baseline.get("tasks") or {}).get(task), kind) is None:
            raise UsageError(f"gate {gate.text!r}: baseline {baseline_path} has no per-item "
                             f"results for task {task}", _baseline_remedy(baseline_path))
        return
    if not config.reference:
        raise UsageError(f"gate {gate.text!r} compares with a reference's answers item by item",
                         "pass --reference MODEL or --baseline REPORT.json")
    if is_store(config.reference) or not config.reference_tasks:
        raise UsageError(f"gate {gate.text!r}: the reference's tasks are not run",
                         "pass --reference MODEL (a model, not a stored .safetensors, and "
                         "without --no-reference-tasks) or --baseline REPORT.json")


def _paired(gates, report: dict, baseline: dict | None, baseline_path) -> dict | None:
    from llmctl.eval.paired import paired_counts

    metrics = [g.metric for g in gates if g.form == "delta"]
    if not metrics:
        return None
    if baseline is not None:
        return paired_counts(metrics, report["tasks"], baseline.get("tasks"),
                             f"baseline {baseline_path}", _baseline_remedy(baseline_path))
    return paired_counts(metrics, report["tasks"], report.get("reference_tasks"),
                         "the reference run", "run the reference on the same --tasks")


def _evaluate(out, args: dict) -> None:
    from llmctl.errors import UsageError
    from llmctl.eval.report import attach_gates, load_report, markdown, write_report
    from llmctl.eval.runner import run_eval
    from llmctl.gates import evaluate_gates, junit_xml, load_gates

    with usage_errors():
        gates = load_gates(args["gate"], args["gate_file"])
    config = _build_config(args)
    with usage_errors():
        baseline = load_report(args["baseline"]) if args["baseline"] else None
    _check_gates(gates, config, baseline, args["baseline"])
    if not config.data and not config.tasks:
        raise UsageError("nothing to evaluate: --data none and no --tasks",
                         "pass --data SOURCE and/or --tasks NAME")

    report = run_eval(config, out)
    results = []
    if gates:
        if baseline is not None:
            _warn_baseline_mismatch(out, report, baseline)
        reference_values = baseline["metrics"] if baseline else report["reference_metrics"]
        try:
            with usage_errors():
                paired = _paired(gates, report, baseline, args["baseline"])
                results = evaluate_gates(gates, report["metrics"], reference_values,
                                         report["counts"], paired)
        except UsageError:
            if args["output"]:  # the run's numbers are still worth keeping
                write_report(report, args["output"])
            raise
        attach_gates(report, results, str(args["baseline"]) if args["baseline"] else None,
                     baseline["metrics"] if baseline else None)
    if args["output"]:
        json_path, md_path = write_report(report, args["output"])
        out.status(f"wrote {json_path} and {md_path}")
    if args["junit"]:
        from llmctl.utils.atomic import write_text

        write_text(args["junit"], junit_xml(results, suite="llmctl-eval"))

    def render(console) -> None:
        from rich.markdown import Markdown

        console.print(Markdown(markdown(report)))

    out.result(report, render)
    for r in results:
        if r.warning:
            out.warn(r.warning)
    failed = [r for r in results if not r.passed]
    if failed:
        listing = "; ".join(f"{r.gate.text} ({r.describe()})" for r in failed)
        out.error(f"{len(failed)} of {len(results)} gates failed: {listing}")
        raise typer.Exit(EXIT_GATE_FAILED)


def _warn_baseline_mismatch(out, report: dict, baseline: dict) -> None:
    from llmctl.eval.compare import comparable_problems

    for problem in comparable_problems([baseline, report]):
        out.warn(f"baseline vs this run: {problem.replace('report 2', 'this run')}")


def _compare(out, paths: list[str], all_metrics: bool) -> None:
    from llmctl.errors import UsageError
    from llmctl.eval.compare import compare, markdown

    if len(paths) < 2:
        raise UsageError("compare needs at least two eval reports",
                         "llmctl eval compare A.json B.json [C.json ...]")
    result = compare([Path(p) for p in paths], all_metrics)

    def render(console) -> None:
        from rich.markdown import Markdown

        console.print(Markdown(markdown(result)))

    out.result(result, render)
