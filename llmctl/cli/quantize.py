"""``llmctl quantize`` (planned): GPTQ, AWQ, FP8, INT8, RTN and GGUF from YAML recipes."""

from __future__ import annotations

import typer

from llmctl.cli.errors import guarded, not_available
from llmctl.cli.options import JsonOpt, ModelArg


def register(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def quantize(
        model: ModelArg,
        recipe: str = typer.Option(None, "--recipe", "-r", help="YAML recipe (see recipes/)."),
        calibration: str = typer.Option(None, "--calibration", "-c",
                                        help="Calibration text: file, hf:NAME or built-in."),
        output: str = typer.Option(None, "--output", "-o", help="Output directory or .gguf."),
        format_: str = typer.Option("compressed-tensors", "--format",
                                    help="compressed-tensors | gguf."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan, run nothing."),
        json_: JsonOpt = False,
    ) -> None:
        """Quantize a model from a recipe into a checkpoint other tools load."""
        not_available("quantize", 3)
