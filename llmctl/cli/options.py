"""Option aliases shared by several commands, defined once."""

from __future__ import annotations

from typing import Annotated

import typer

ModelArg = Annotated[
    str,
    typer.Argument(help="HF checkpoint dir, .gguf file, hub id (org/name) or 'smollm2-135m'.",
                   show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
OutputOpt = Annotated[str, typer.Option("--output", "-o", help="Output path.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Random seed.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="float32 | bfloat16 | float16.")]
