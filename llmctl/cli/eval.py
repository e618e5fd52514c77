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

import typer

from llmctl.cli.errors import guarded, usage_errors
from llmctl.cli.options import JsonOpt

EXIT_GATE_FAILED = 1


def register(app: typer.Typer) -> None:
    @app.command("eval")
    @guarded
    def eval_(
        candidate: str = typer.Argument(
            ..., show_default=False,
            help="Model to evaluate: HF/compressed-tensors dir, .gguf, 'smollm2-135m', hub id, "
                 "an engine directory from `llmctl build-engine` (ONNX / torch-compile; "
                 "also engine:DIR), or openai:http://HOST:PORT (a server). Or 'compare' "
                 "followed by report files."),
        more: list[str] | None = typer.Argument(
            None, show_default=False, help="With 'compare': the eval reports (JSON) to compare."),
        reference: str | None = typer.Option(
            None, "--reference", "-r", help="Reference model (or a stored reference .safetensors)."),
        data: str = typer.Option("builtin:pydoc-heldout", "--data", "-d",
                                 help="Text for perplexity/KLD: .txt/.jsonl/.parquet, hf:NAME, "
                                      "builtin:pydoc-heldout, or 'none'."),
        field: str = typer.Option("text", "--field", help="Text field of .jsonl/.parquet/hf data."),
        ctx: int = typer.Option(512, "--ctx", help="Tokens per window."),
        stride: int | None = typer.Option(None, "--stride",
                                             help="Window step (< ctx overlaps; default ctx)."),
        bos: str = typer.Option("auto", "--bos", help="auto (as the tokenizer) | always | never."),
        score_from: int = typer.Option(0, "--score-from",
                                       help="Score only tokens at index >= N in each window "
                                            "(ctx/2 mimics llama-perplexity)."),
        max_windows: int | None = typer.Option(None, "--max-windows", help="Use at most N windows."),
        top_k: int = typer.Option(64, "--top-k", help="Reference log-probs kept per token."),
        tasks: list[str] | None = typer.Option(
            None, "--tasks", help="builtin | python-mc,science-mc,everyday-mc | FILE.jsonl | "
                                  "lm_eval:NAME (repeatable, comma-separated)."),
        task_dir: Path | None = typer.Option(None, "--task-dir",
                                                help="lm-eval task YAML directory (include path)."),
        task_limit: int | None = typer.Option(None, "--task-limit", help="Items per task."),
        gate: list[str] | None = typer.Option(
            None, "--gate", help="e.g. 'ppl_ratio<=1.05', 'mean_kld<=0.05', "
                                 "'wilson(task.science-mc.acc)>=0.9*reference' (repeatable)."),
        gate_file: Path | None = typer.Option(None, "--gate-file", help="YAML with gates: [...]"),
        baseline: Path | None = typer.Option(
            None, "--baseline", help="Eval report whose metrics are the 'reference' in gates."),
        junit: Path | None = typer.Option(None, "--junit", help="Write gate results as JUnit XML."),
        output: Path | None = typer.Option(None, "--output", "-o",
                                              help="Report JSON (Markdown written next to it)."),
        cache_dir: Path | None = typer.Option(None, "--cache-dir",
                                                 help="Reference store directory."),
        dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16."),
        backend: str = typer.Option("auto", "--backend",
                                    help="auto | transformers | llama-cpp (for .gguf)."),
        server_model: str | None = typer.Option(None, "--server-model",
                                                   help="Model name on the server."),
        tokenizer: str | None = typer.Option(None, "--tokenizer",
                                                help="Tokenizer for a server without --reference."),
        threads: int | None = typer.Option(None, "--threads", min=1,
                                           help="torch / llama.cpp / engine runtime threads."),
        seed: int = typer.Option(0, "--seed", help="Seed (lm-eval sampling; recorded)."),
        no_reference_tasks: bool = typer.Option(
            False, "--no-reference-tasks", help="Do not run tasks on the reference model."),
        all_metrics: bool = typer.Option(False, "--all", help="compare: every metric."),
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
        reference_tasks=not args["no_reference_tasks"] and args["baseline"] is None,
        seed=args["seed"], dtype=args["dtype"], backend=args["backend"],
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


def _check_gates(gates, config, baseline) -> None:
    from llmctl.errors import UsageError
    from llmctl.eval.runner import expected_metrics

    produced = expected_metrics(config)
    for g in gates:
        if g.metric not in produced:
            raise UsageError(f"gate {g.text!r}: this run produces no metric {g.metric!r}",
                             f"{_missing_metric_hint(g.metric, config)}; metrics of this run: "
                             f"{', '.join(sorted(produced)[:12]) or 'none'}, ...")
        if g.relative and baseline is None and not config.reference:
            raise UsageError(f"gate {g.text!r} compares with a reference value",
                             "pass --reference MODEL or --baseline REPORT.json")


def _evaluate(out, args: dict) -> None:
    from llmctl.errors import UsageError
    from llmctl.eval.report import attach_gates, load_report, markdown, write_report
    from llmctl.eval.runner import run_eval
    from llmctl.gates import evaluate_gates, junit_xml, load_gates

    with usage_errors():
        gates = load_gates(args["gate"], args["gate_file"])
    config = _build_config(args)
    baseline = load_report(args["baseline"]) if args["baseline"] else None
    _check_gates(gates, config, baseline)
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
                results = evaluate_gates(gates, report["metrics"], reference_values,
                                         report["counts"])
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
    failed = [r for r in results if not r.passed]
    if failed:
        listing = "; ".join(f"{r.gate.text} (got {r.compared:.6g}, threshold {r.threshold:.6g})"
                            for r in failed)
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
