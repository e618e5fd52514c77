"""Option aliases shared by several commands, defined once (choices and ranges included,
so typer rejects a bad value with exit 2 before any work starts)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

ModelArg = Annotated[
    str,
    typer.Argument(help="HF checkpoint dir, .gguf file, hub id (org/name) or 'smollm2-135m'.",
                   show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
OutputOpt = Annotated[str, typer.Option("--output", "-o", help="Output path.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Random seed.")]

Dtype = Literal["auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"]
DtypeOpt = Annotated[
    Dtype,
    typer.Option("--dtype", help="auto: bfloat16 where the CPU computes it natively "
                                 "(AVX512-BF16/AMX), else float32; on a GPU the checkpoint's "
                                 "dtype. Or float32 | bfloat16 | float16."),
]
KvCacheDtype = Literal["auto", "bfloat16", "float16", "float32", "int8", "fp8", "fp8_e4m3"]
KvCacheDtypeOpt = Annotated[
    KvCacheDtype,
    typer.Option("--kv-cache-dtype",
                 help="KV cache: auto (the model's dtype; fp8 when the checkpoint has an "
                      "FP8 kv_cache_scheme, as in vLLM) | bfloat16 | float16 | float32 | "
                      "int8 (a scale per token and KV head: ~1.9x the tokens of bfloat16 "
                      "in the same memory) | fp8 = fp8_e4m3 (static scales per layer and "
                      "KV head, from the checkpoint's kv_cache_scheme or calibrated at "
                      "start: 2x)."),
]
Device = Literal["cpu", "cuda"]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", min=1,
                                                help="torch threads (default: all cores).")]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]

GateOpt = Annotated[list[str] | None, typer.Option(
    "--gate", help="Fail (exit 1) unless e.g. 'p99_ttft_ms<=500' holds (repeatable).")]
GateFileOpt = Annotated[Path | None, typer.Option("--gate-file",
                                                  help="YAML file with gates: [...].")]
JunitOpt = Annotated[Path | None, typer.Option("--junit",
                                               help="Write gate results as JUnit XML.")]
