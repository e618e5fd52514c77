"""``llmctl batch INPUT.jsonl -o OUTPUT.jsonl MODEL``: an OpenAI Batch API file through
the built-in engine, in this process, no HTTP. Each output line holds what ``llmctl
serve`` would answer for that line's body; rerunning the same command resumes.

Exit codes: 0 every line succeeded; 1 some lines failed (their error bodies are in
OUTPUT) or the run failed; 2 a usage error (missing input, unwritable output, duplicate
custom_ids, bad options); 130 interrupted (finished lines are kept: rerun to resume).
The work is in :mod:`llmctl.serve.batch.runner`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmctl.cli.errors import guarded
from llmctl.cli.options import DtypeOpt, JsonOpt, KvCacheDtypeOpt
from llmctl.cli.serve import (
    EnableAutoToolChoice,
    KvCacheMemory,
    LoraOpt,
    MaxBatchedTokens,
    MaxLoraRank,
    MaxModelLen,
    MaxNumSeqs,
    ServedName,
    ServeModelArg,
    Threads,
    ToolCallParser,
    _given,
)

InputArg = Annotated[Path, typer.Argument(
    help="JSONL of OpenAI batch requests: custom_id, method POST, url /v1/chat/completions, "
         "/v1/completions or /v1/embeddings, body.", show_default=False)]
OutputOpt = Annotated[Path, typer.Option(
    "--output", "-o", help="JSONL of results, one line per request in the order they finish "
                           "(match by custom_id). Lines already there are skipped (resume).",
    show_default=False)]
Window = Annotated[int | None, typer.Option(
    "--window", min=1, help="Sequences in flight at most (default 4 x --max-num-seqs).")]


def batch(
    ctx: typer.Context, input_file: InputArg, model: ServeModelArg, output: OutputOpt,
    served_model_name: ServedName = None, dtype: DtypeOpt = "auto",
    kv_cache_dtype: KvCacheDtypeOpt = "auto", kv_cache_memory: KvCacheMemory = "2GiB",
    max_model_len: MaxModelLen = None,
    max_num_seqs: MaxNumSeqs = 64, max_num_batched_tokens: MaxBatchedTokens = 512,
    threads: Threads = None, window: Window = None, lora: LoraOpt = None,
    max_lora_rank: MaxLoraRank = 64, enable_auto_tool_choice: EnableAutoToolChoice = False,
    tool_call_parser: ToolCallParser = None, json_: JsonOpt = False,
) -> None:
    """Run an OpenAI Batch API input file on a model; resumable."""
    import llmctl.engines  # noqa: F401 - registers engine directories as a model source
    from llmctl.cli.output import Output
    from llmctl.serve.batch.runner import check_paths, run_batch, stop_on_signals
    from llmctl.serve.engine.config import EngineConfig
    from llmctl.serve.engine.sources import CheckpointSource, source_for
    from llmctl.serve.launch.startup import ServeSettings, auto_tool_parser, engine_kwargs

    out = Output(json_mode=json_)
    check_paths(input_file, output)
    names = ("dtype", "kv_cache_dtype", "kv_cache_memory", "max_model_len", "max_num_seqs",
             "max_num_batched_tokens", "threads")
    settings = ServeSettings(model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                             kv_cache_memory=kv_cache_memory,
                             max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, threads=threads,
                             lora=tuple(lora or ()), max_lora_rank=max_lora_rank,
                             enable_auto_tool_choice=enable_auto_tool_choice,
                             tool_call_parser=tool_call_parser,
                             given=frozenset(n for n in names if _given(ctx, n)))
    tool_parser = auto_tool_parser(settings)  # a parser missing or unknown: exit 2
    kwargs = engine_kwargs(settings, not isinstance(source_for(model), CheckpointSource))
    EngineConfig(model=model, **kwargs)  # a bad option fails before anything loads (exit 2)
    with out.progress("batch") as update, stop_on_signals() as stopped:
        summary = run_batch(input_file, output, model, kwargs,
                            served_model_name=served_model_name, window=window, stop=stopped,
                            progress=update, say=out.status, auto_tool_parser=tool_parser)

    def render(console) -> None:
        console.print(f"{summary.written} lines written to {output} ({summary.skipped} "
                      f"already there, {summary.lines} in the input); "
                      f"{summary.completion_tokens} tokens generated in {summary.seconds:.1f} s "
                      f"({summary.output_throughput:.1f} tok/s)", markup=False)

    out.result(summary.to_dict(), render)
    if summary.interrupted:
        out.error(f"interrupted: {summary.skipped + summary.written} of {summary.lines} lines "
                  f"are in {output}", "run the same command again to resume")
        raise typer.Exit(130)
    if summary.failed:
        out.error(f"{summary.failed} of {summary.lines} lines failed (see their error bodies "
                  f"in {output})", "lines already in the output are skipped on a rerun: "
                                   "remove the failed ones from it to retry them")
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command()(guarded(batch))
