"""``llmctl bench``: latency/throughput of an OpenAI-compatible endpoint, and
``llmctl bench compare``: reports side by side."""

from __future__ import annotations

from pathlib import Path

import typer

from llmctl.cli.errors import guarded
from llmctl.cli.options import JsonOpt

EXIT_GATES_FAILED = 1
EXIT_TARGET_DOWN = 1
EXIT_INTERRUPTED = 130


def _command_line() -> str | None:
    import os
    import shlex
    import sys

    if os.path.basename(sys.argv[0]) in ("llmctl", "__main__.py"):
        return shlex.join(["llmctl", *sys.argv[1:]])
    return None


def _render_gates(console, results) -> None:
    from rich.table import Table

    table = Table(title="Gates", title_justify="left")
    for name in ("gate", "value", "threshold", "result"):
        table.add_column(name, justify="left" if name == "gate" else "right")
    for r in results:
        verdict = "[green]pass[/green]" if r.passed else "[bold red]FAIL[/bold red]"
        table.add_row(r.gate.text, f"{r.compared:.4g}", f"{r.gate.op} {r.threshold:.4g}",
                      verdict)
    console.print(table)


def _check_gates(gates, reports: list[dict], junit: Path | None) -> list:
    """Evaluate gates on every report (each sweep level); optionally write JUnit XML."""
    from llmctl.gates import evaluate_gates, junit_xml
    from llmctl.utils.atomic import write_text

    results = []
    for report in reports:
        results.extend(evaluate_gates(gates, report))
    if junit is not None:
        write_text(Path(junit), junit_xml(results, "llmctl-bench"))
    return results


def register(app: typer.Typer) -> None:
    bench_app = typer.Typer(help="Measure latency and throughput of an OpenAI-compatible "
                                 "endpoint; compare reports.", no_args_is_help=False)

    @bench_app.callback(invoke_without_command=True)
    @guarded
    def bench(
        ctx: typer.Context,
        target: str = typer.Option(None, "--target",
                                   help="Base URL of a running server (http://host:port). "
                                        "Without it, llmctl's own server is started."),
        model: str = typer.Option(None, "--model", "-m",
                                  help="Model: sent as the request's model and used for its "
                                       "tokenizer and checkpoint hash."),
        served_model_name: str = typer.Option(None, "--served-model-name",
                                              help="Name in requests if not --model."),
        tokenizer: str = typer.Option(None, "--tokenizer",
                                      help="Tokenizer dir or model (default: --model's)."),
        backend: str = typer.Option("openai-completions", "--backend",
                                    help="openai-completions | openai-chat."),
        endpoint: str = typer.Option(None, "--endpoint", help="Override the endpoint path."),
        api_key: str = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY",
                                    help="Bearer token (default $OPENAI_API_KEY)."),
        dataset: str = typer.Option("random", "--dataset",
                                    help="random | sharegpt | jsonl | prefix | long-context."),
        dataset_path: str = typer.Option(None, "--dataset-path",
                                         help="File (or hf:/builtin: source) for the dataset."),
        prompt_field: str = typer.Option("prompt", "--prompt-field",
                                         help="JSONL/parquet field holding the prompt."),
        num_prompts: int = typer.Option(100, "--num-prompts", "-n", min=1),
        input_len: int = typer.Option(None, "--input-len", min=1,
                                      help="Prompt tokens (mean) [random 256, prefix question "
                                           "64, long-context 4096]."),
        input_len_std: float = typer.Option(0.0, "--input-len-std", min=0.0),
        output_len: int = typer.Option(None, "--output-len", min=1,
                                       help="max_tokens (mean) [128; prefix 64]."),
        output_len_std: float = typer.Option(0.0, "--output-len-std", min=0.0),
        num_prefixes: int = typer.Option(4, "--num-prefixes", min=1,
                                         help="prefix: shared system prompts."),
        prefix_len: int = typer.Option(256, "--prefix-len", min=1,
                                       help="prefix: tokens per system prompt."),
        questions_per_prefix: int = typer.Option(None, "--questions-per-prefix", min=1,
                                                 help="prefix: questions per system prompt "
                                                      "(default num-prompts / num-prefixes)."),
        ignore_eos: bool = typer.Option(False, "--ignore-eos",
                                        help="Ask the server to generate exactly max_tokens."),
        request_rate: str = typer.Option("inf", "--request-rate",
                                         help="Requests/s (Poisson/gamma arrivals) or inf."),
        burstiness: float = typer.Option(1.0, "--burstiness",
                                         help="Gamma shape: 1 Poisson, <1 burstier, >1 "
                                              "smoother."),
        max_concurrency: int = typer.Option(None, "--max-concurrency", min=1),
        warmup: int = typer.Option(0, "--warmup", min=0,
                                   help="Requests sent before the measurement."),
        duration: float = typer.Option(None, "--duration",
                                       help="Stop sending after this many seconds."),
        seed: int = typer.Option(0, "--seed", help="Seed of prompts and arrival times."),
        temperature: float = typer.Option(0.0, "--temperature", min=0.0),
        percentiles: str = typer.Option("50,90,95,99", "--percentiles"),
        slo: list[str] = typer.Option(None, "--slo",
                                      help="Goodput SLO, e.g. ttft_ms=500 (repeatable)."),
        gate: list[str] = typer.Option(None, "--gate",
                                       help="Fail (exit 1) unless e.g. 'p99_ttft_ms<=500'."),
        gate_file: Path = typer.Option(None, "--gate-file", help="YAML file with gates: [...]."),
        junit: Path = typer.Option(None, "--junit", help="Write gate results as JUnit XML."),
        sweep: str = typer.Option(None, "--sweep",
                                  help="One run per level: concurrency=1,4,16 or rate=1,2,inf."),
        repeat: int = typer.Option(1, "--repeat", min=1,
                                   help="Runs per level; the report keeps median and spread."),
        label: str = typer.Option(None, "--label", help="Report label (default: backend)."),
        result_dir: str = typer.Option(".", "--result-dir", help="Where reports go."),
        result_filename: str = typer.Option(None, "--result-filename", "-o",
                                            help="Report file name (default carries the "
                                                 "configuration)."),
        no_plots: bool = typer.Option(False, "--no-plots", help="Skip the PNG plots."),
        request_timeout: float = typer.Option(600.0, "--request-timeout"),
        metrics_interval: float = typer.Option(1.0, "--metrics-interval",
                                               help="Seconds between /metrics samples; 0 off."),
        server_command: str = typer.Option(None, "--server-command",
                                           help="Command that starts the server ({port}, "
                                                "{model} filled in) instead of llmctl serve."),
        serve_args: str = typer.Option(None, "--serve-args",
                                       help="Extra flags for the launched llmctl serve."),
        server_timeout: float = typer.Option(600.0, "--server-timeout",
                                             help="Seconds to wait for GET /health."),
        json_: JsonOpt = False,
    ) -> None:
        """Measure TTFT, TPOT, ITL, E2E latency and throughput of an endpoint."""
        if ctx.invoked_subcommand is not None:
            return
        try:
            import httpx  # noqa: F401
        except ImportError:
            from llmctl.errors import MissingDependencyError

            raise MissingDependencyError("llmctl bench needs httpx",
                                         "pip install 'llmctl[serve]' (or httpx)") from None
        from llmctl.bench.arrivals import parse_rate
        from llmctl.bench.backends import get_backend
        from llmctl.bench.config import BenchOptions, parse_percentiles, parse_sweep
        from llmctl.bench.datasets import DatasetSpec
        from llmctl.bench.metrics import parse_slos
        from llmctl.bench.report import render
        from llmctl.bench.suite import run_suite
        from llmctl.cli.output import Output
        from llmctl.gates import load_gates

        out = Output(json_mode=json_)
        gates = load_gates(gate, gate_file)  # a bad gate fails before anything runs
        get_backend(backend)
        opts = BenchOptions(
            target=target, model=model, served_model_name=served_model_name,
            tokenizer=tokenizer, backend=backend, endpoint=endpoint,
            dataset=DatasetSpec(name=dataset, path=dataset_path, prompt_field=prompt_field,
                                num_prompts=num_prompts, input_len=input_len,
                                input_len_std=input_len_std, output_len=output_len,
                                output_len_std=output_len_std, num_prefixes=num_prefixes,
                                prefix_len=prefix_len,
                                questions_per_prefix=questions_per_prefix, seed=seed),
            request_rate=parse_rate(request_rate), burstiness=burstiness,
            max_concurrency=max_concurrency, warmup=warmup, duration=duration,
            ignore_eos=ignore_eos, temperature=temperature,
            percentiles=parse_percentiles(percentiles), slos=parse_slos(slo),
            sweep=parse_sweep(sweep), repeat=repeat, label=label, result_dir=result_dir,
            result_filename=result_filename, request_timeout=request_timeout,
            metrics_interval=metrics_interval or None, server_command=server_command,
            serve_args=serve_args, server_timeout=server_timeout, plots=not no_plots)
        result = run_suite(opts, out, command=_command_line(), api_key=api_key)
        for warning in result.warnings:
            out.warn(f"{warning}; plots skipped")
        reports = [lv.report for lv in result.levels]
        data = {"reports": [str(lv.path) for lv in result.levels],
                "sweep": str(result.sweep_path) if result.sweep_path else None,
                "interrupted": result.interrupted, "target_down": result.target_down,
                "results": [{k: v for k, v in r.items()
                             if isinstance(v, (int, float, str)) or v is None}
                            for r in reports]}

        gate_results = []
        if gates and not result.interrupted and not result.target_down:
            gate_results = _check_gates(gates, reports, junit)
            data["gates"] = [r.to_dict() for r in gate_results]
        passed = all(r.passed for r in gate_results)

        def show(console) -> None:
            for lv in result.levels:
                render(console, lv.report)
                console.print(f"[dim]report: {lv.path}[/dim]")
            if result.sweep_path:
                console.print(f"[dim]sweep summary: {result.sweep_path}[/dim]")
            if gate_results:
                _render_gates(console, gate_results)

        out.result(data, show)
        if result.interrupted:
            out.error("interrupted: the partial report above was written")
            raise typer.Exit(EXIT_INTERRUPTED)
        if result.target_down:
            out.error(f"the target went down during the run ({result.target_down})",
                      "the report with the failed requests was written; check the server")
            raise typer.Exit(EXIT_TARGET_DOWN)
        if not passed:
            out.error("performance gates failed (see the table)")
            raise typer.Exit(EXIT_GATES_FAILED)

    @bench_app.command("compare")
    @guarded
    def compare(
        reports: list[Path] = typer.Argument(..., help="Report JSON files; the first is the "
                                                      "baseline."),
        metric: list[str] = typer.Option(None, "--metric", help="Only these metrics."),
        gate: list[str] = typer.Option(None, "--gate",
                                       help="Gate the last report, e.g. "
                                            "'output_throughput>=0.95*reference'."),
        gate_file: Path = typer.Option(None, "--gate-file"),
        json_: JsonOpt = False,
    ) -> None:
        """Side-by-side table of reports with deltas and ratios against the first."""
        from llmctl.bench import compare as cmp
        from llmctl.bench.report import load_json
        from llmctl.cli.output import Output
        from llmctl.errors import UsageError
        from llmctl.gates import evaluate_gates, load_gates

        out = Output(json_mode=json_)
        if len(reports) < 2:
            raise UsageError("compare needs at least two reports", "pass BASELINE.json OTHER.json")
        gates = load_gates(gate, gate_file)
        loaded = [load_json(p) for p in reports]
        names = [p.stem for p in reports]
        rows = cmp.compare(loaded, metric or None)
        note = cmp.noise_note(loaded)
        data = {**cmp.to_dict(rows, names), "note": note}
        results = evaluate_gates(gates, loaded[-1], reference=loaded[0]) if gates else []
        if results:
            data["gates"] = [r.to_dict() for r in results]
        out.result(data, lambda console: (cmp.render(console, rows, names, note),
                                          results and _render_gates(console, results)))
        if results and not all(r.passed for r in results):
            out.error("performance gates failed (see the table)")
            raise typer.Exit(EXIT_GATES_FAILED)

    app.add_typer(bench_app, name="bench")
