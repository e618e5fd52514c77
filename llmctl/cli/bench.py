"""``llmctl bench``: latency/throughput of an OpenAI-compatible endpoint, and
``llmctl bench compare``: reports side by side. The work is in :mod:`llmctl.bench`
(:func:`~llmctl.bench.suite.run_suite`, :mod:`~llmctl.bench.verdict`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmctl.cli.errors import guarded, usage_errors
from llmctl.cli.options import Dtype, GateFileOpt, GateOpt, JsonOpt, JunitOpt

Opt = typer.Option
Target = Annotated[str | None, Opt("--target", help="Base URL of a running server "
                                   "(http://host:port). Without it, llmctl's own server is "
                                   "started.")]
Model = Annotated[str | None, Opt("--model", "-m", help="Model: sent as the request's model "
                                  "and used for its tokenizer and checkpoint hash.")]
ServedName = Annotated[str | None, Opt("--served-model-name",
                                       help="Name in requests if not --model.")]
Tokenizer = Annotated[str | None, Opt("--tokenizer",
                                      help="Tokenizer dir or model (default: --model's).")]
Backend = Annotated[str, Opt("--backend", help="openai-completions | openai-chat.")]
Endpoint = Annotated[str | None, Opt("--endpoint", help="Override the endpoint path.")]
ApiKey = Annotated[str | None, Opt("--api-key", envvar="OPENAI_API_KEY",
                                   help="Bearer token (default $OPENAI_API_KEY).")]
Dataset = Annotated[str, Opt("--dataset",
                              help="random | sharegpt | jsonl | prefix | long-context | "
                                   "multi-turn | trace.")]
DatasetPath = Annotated[str | None, Opt("--dataset-path", help="File (or hf:/builtin: "
                                        "source) for the dataset.")]
PromptField = Annotated[str, Opt("--prompt-field",
                                 help="JSONL/parquet field holding the prompt.")]
NumPrompts = Annotated[int, Opt("--num-prompts", "-n", min=1)]
InputLen = Annotated[int | None, Opt("--input-len", min=1, help="Prompt tokens (mean; default "
                                     "random 256, prefix question 64, long-context 4096).")]
InputLenStd = Annotated[float, Opt("--input-len-std", min=0.0)]
OutputLen = Annotated[int | None, Opt("--output-len", min=1,
                                      help="max_tokens (mean; default 128, prefix 64).")]
OutputLenStd = Annotated[float, Opt("--output-len-std", min=0.0)]
NumPrefixes = Annotated[int, Opt("--num-prefixes", min=1, help="prefix: shared system "
                                 "prompts.")]
PrefixLen = Annotated[int, Opt("--prefix-len", min=1, help="prefix: tokens per system "
                               "prompt.")]
QuestionsPerPrefix = Annotated[int | None, Opt("--questions-per-prefix", min=1, help="prefix: "
                                               "questions per system prompt (default "
                                               "num-prompts / num-prefixes).")]
Turns = Annotated[int, Opt("--turns", min=1, help="multi-turn: user messages per "
                           "conversation (--num-prompts conversations).")]
ThinkTime = Annotated[float, Opt("--think-time", min=0.0, help="multi-turn: seconds from an "
                                 "answer to the next turn.")]
TraceBlockTokens = Annotated[int, Opt("--trace-block-tokens", min=1, help="trace: prompt "
                                      "tokens per hash id (Mooncake's traces: 512).")]
TraceTimeScale = Annotated[float, Opt("--trace-time-scale",
                                      help="trace: replay speed (2 = twice as fast).")]
IgnoreEos = Annotated[bool, Opt("--ignore-eos",
                                help="Ask the server to generate exactly max_tokens.")]
RequestRate = Annotated[str, Opt("--request-rate",
                                 help="Requests/s (Poisson/gamma arrivals) or inf.")]
Burstiness = Annotated[float, Opt("--burstiness", help="Gamma shape (> 0): 1 Poisson, <1 "
                                  "burstier, >1 smoother.")]
MaxConcurrency = Annotated[int | None, Opt("--max-concurrency", min=1)]
Warmup = Annotated[int, Opt("--warmup", min=0, help="Requests sent before the measurement.")]
Duration = Annotated[float | None, Opt("--duration", help="Stop sending after this many "
                                       "seconds (> 0).")]
Seed = Annotated[int, Opt("--seed", help="Seed of prompts and arrival times.")]
Temperature = Annotated[float, Opt("--temperature", min=0.0)]
Percentiles = Annotated[str, Opt("--percentiles")]
Slo = Annotated[list[str] | None, Opt("--slo", help="Goodput SLO per request, e.g. "
                                      "ttft_ms=500 (repeatable); with --find-capacity "
                                      "percentile bounds: 'p95_ttft_ms<=500,p95_tpot_ms<=100'.")]
FindCapacity = Annotated[bool, Opt("--find-capacity", help="Search the highest load whose "
                                   "run meets --slo's percentile bounds (doubling, then "
                                   "bisection; the knee is rerun); over-saturated levels "
                                   "stop early.")]
By = Annotated[str | None, Opt("--by", help="--find-capacity: the load searched, rate "
                               "(default) | concurrency.")]
CapacityStart = Annotated[float | None, Opt("--capacity-start", help="First level searched "
                                            "(default 1).")]
CapacityMax = Annotated[float | None, Opt("--capacity-max", help="Highest level searched "
                                          "(default 1024).")]
CapacityResolution = Annotated[str | None, Opt("--capacity-resolution", help="Stop bisecting "
                                               "when the bracket is this narrow: 10% (default) "
                                               "of the level, or an absolute step.")]
CapacityConfirm = Annotated[int | None, Opt("--capacity-confirm", min=0, help="Reruns of the "
                                            "knee it must also pass (default 1).")]
NoEarlyStop = Annotated[bool, Opt("--no-early-stop", help="--find-capacity: run "
                                  "over-saturated levels to the end.")]
Sweep = Annotated[str | None, Opt("--sweep", help="One run per level: concurrency=1,4,16 or "
                                  "rate=1,2,inf.")]
Repeat = Annotated[int, Opt("--repeat", min=1,
                            help="Runs per level; the report keeps median and spread.")]
Label = Annotated[str | None, Opt("--label", help="Report label (default: backend).")]
ResultDir = Annotated[str, Opt("--result-dir", help="Where reports go.")]
ResultFilename = Annotated[str | None, Opt("--result-filename", "-o", help="Report file name "
                                           "(default carries the configuration).")]
NoPlots = Annotated[bool, Opt("--no-plots", help="Skip the PNG plots.")]
RequestTimeout = Annotated[float, Opt("--request-timeout", help="Seconds (> 0).")]
MetricsInterval = Annotated[float, Opt("--metrics-interval", min=0.0,
                                       help="Seconds between /metrics samples; 0 off.")]
ServerCommand = Annotated[str | None, Opt("--server-command", help="Command that starts the "
                                          "server ({port}, {model} filled in) instead of "
                                          "llmctl serve.")]
ServeArgs = Annotated[str | None, Opt("--serve-args",
                                      help="Extra flags for the launched llmctl serve.")]
ServerTimeout = Annotated[float, Opt("--server-timeout",
                                     help="Seconds to wait for GET /health.")]
BenchDtype = Annotated[Dtype, Opt("--dtype", help="dtype of the llmctl serve that bench "
                                  "starts: auto (bfloat16 where the CPU computes it natively, "
                                  "else float32) | float32 | bfloat16 | float16.")]
Hardware = Annotated[str | None, Opt("--hardware", help="What MFU/MBU are measured "
                                     "against: a GPU of `llmctl plan`'s table (h100-80gb, "
                                     "...) or this (the cached `llmctl hw probe`; the "
                                     "default on a CPU).")]
PeakFlops = Annotated[float | None, Opt("--peak-flops", help="Peak FLOP/s of the run's "
                                        "dtype, replacing the table's or the probe's.")]
PeakBandwidth = Annotated[float | None, Opt("--peak-bandwidth", help="Peak memory read "
                                            "bytes/s, replacing the table's or the probe's.")]
CostPerHour = Annotated[float | None, Opt("--cost-per-hour", help="USD per hour of the "
                                          "machine: $ per 1M input/output tokens and per "
                                          "request in the report (gate on cost_*).")]
Reports = Annotated[list[Path], typer.Argument(help="Report JSON files; the first is the "
                                                     "baseline.")]
Metric = Annotated[list[str] | None, Opt("--metric", help="Only these metrics.")]

# Options that are not the run's configuration (BenchOptions): secrets, gates, output mode.
_NOT_BENCH_OPTIONS = {"ctx", "api_key", "gate", "gate_file", "junit", "json_"}


def bench(
    ctx: typer.Context, target: Target = None, model: Model = None,
    served_model_name: ServedName = None, tokenizer: Tokenizer = None,
    backend: Backend = "openai-completions", endpoint: Endpoint = None, api_key: ApiKey = None,
    dataset: Dataset = "random", dataset_path: DatasetPath = None,
    prompt_field: PromptField = "prompt", num_prompts: NumPrompts = 100,
    input_len: InputLen = None, input_len_std: InputLenStd = 0.0, output_len: OutputLen = None,
    output_len_std: OutputLenStd = 0.0, num_prefixes: NumPrefixes = 4,
    prefix_len: PrefixLen = 256, questions_per_prefix: QuestionsPerPrefix = None,
    turns: Turns = 3, think_time: ThinkTime = 0.0, trace_block_tokens: TraceBlockTokens = 512, trace_time_scale: TraceTimeScale = 1.0,
    ignore_eos: IgnoreEos = False, request_rate: RequestRate = "inf",
    burstiness: Burstiness = 1.0, max_concurrency: MaxConcurrency = None, warmup: Warmup = 0,
    duration: Duration = None, seed: Seed = 0, temperature: Temperature = 0.0,
    percentiles: Percentiles = "50,90,95,99", slo: Slo = None,
    find_capacity: FindCapacity = False, by: By = None, capacity_start: CapacityStart = None,
    capacity_max: CapacityMax = None, capacity_resolution: CapacityResolution = None,
    capacity_confirm: CapacityConfirm = None, no_early_stop: NoEarlyStop = False,
    gate: GateOpt = None,
    gate_file: GateFileOpt = None, junit: JunitOpt = None, sweep: Sweep = None,
    repeat: Repeat = 1, label: Label = None, result_dir: ResultDir = ".",
    result_filename: ResultFilename = None, no_plots: NoPlots = False,
    request_timeout: RequestTimeout = 600.0, metrics_interval: MetricsInterval = 1.0,
    server_command: ServerCommand = None, serve_args: ServeArgs = None,
    server_timeout: ServerTimeout = 600.0, dtype: BenchDtype = "auto",
    hardware: Hardware = None, peak_flops: PeakFlops = None,
    peak_bandwidth: PeakBandwidth = None, cost_per_hour: CostPerHour = None,
    json_: JsonOpt = False,
) -> None:
    """Measure TTFT, TPOT, ITL, E2E latency and throughput of an endpoint, or with
    --find-capacity the highest load that meets an SLO."""
    if ctx.invoked_subcommand is not None:
        return
    flags = {k: v for k, v in locals().items() if k not in _NOT_BENCH_OPTIONS}
    from llmctl.bench.config import options_from_flags
    from llmctl.bench.suite import run_suite
    from llmctl.bench.verdict import run_verdict, show_run
    from llmctl.cli.output import Output
    from llmctl.gates import load_gates
    from llmctl.utils.cmdline import command_line

    out = Output(json_mode=json_)
    with usage_errors():  # a bad gate fails before anything runs
        gates = load_gates(gate, gate_file)
    opts = options_from_flags(**flags)
    result = run_suite(opts, out, command=command_line(), api_key=api_key)
    for warning in result.warnings:
        out.warn(f"{warning}; plots skipped")
    with usage_errors():  # a gate on a metric the run does not produce
        verdict = run_verdict(result, gates, junit)
    out.result(verdict.data, lambda console: show_run(console, result, verdict))
    _exit(out, verdict)


def compare(reports: Reports, metric: Metric = None, gate: GateOpt = None,
            gate_file: GateFileOpt = None, json_: JsonOpt = False) -> None:
    """Side-by-side table of reports with deltas and ratios against the first; --gate
    checks the last against the first (e.g. 'output_throughput>=0.95*reference')."""
    from llmctl.bench import compare as cmp
    from llmctl.bench.report import load_json
    from llmctl.bench.verdict import compare_verdict, render_gates
    from llmctl.cli.output import Output
    from llmctl.errors import UsageError
    from llmctl.gates import load_gates

    out = Output(json_mode=json_)
    if len(reports) < 2:
        raise UsageError("compare needs at least two reports", "pass BASELINE.json OTHER.json")
    with usage_errors():
        gates = load_gates(gate, gate_file)
    loaded = [load_json(p) for p in reports]
    names = [p.stem for p in reports]
    rows = cmp.compare(loaded, metric or None)
    note = cmp.noise_note(loaded)
    with usage_errors():
        verdict = compare_verdict({**cmp.to_dict(rows, names), "note": note}, gates,
                                  loaded[0], loaded[-1])
    out.result(verdict.data, lambda console: (
        cmp.render(console, rows, names, note),
        verdict.gate_results and render_gates(console, verdict.gate_results)))
    _exit(out, verdict)


def _exit(out, verdict) -> None:
    if verdict.error:
        out.error(verdict.error, verdict.remedy)
    if verdict.exit_code:
        raise typer.Exit(verdict.exit_code)


def register(app: typer.Typer) -> None:
    bench_app = typer.Typer(help="Measure latency and throughput of an OpenAI-compatible "
                                 "endpoint; compare reports.", no_args_is_help=False)
    bench_app.callback(invoke_without_command=True)(guarded(bench))
    bench_app.command("compare")(guarded(compare))
    app.add_typer(bench_app, name="bench")
