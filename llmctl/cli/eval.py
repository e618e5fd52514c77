"""``llmctl eval`` (planned): perplexity, KL divergence, task accuracy, quality gates."""

from __future__ import annotations

import typer

from llmctl.cli.errors import guarded, not_available
from llmctl.cli.options import JsonOpt, ModelArg


def register(app: typer.Typer) -> None:
    @app.command("eval")
    @guarded
    def eval_(
        model: ModelArg,
        reference: str = typer.Option(None, "--reference", help="Reference model."),
        data: str = typer.Option(None, "--data", help="Text source for perplexity/KLD."),
        tasks: str = typer.Option(None, "--tasks", help="Comma-separated task names."),
        gate: list[str] = typer.Option(None, "--gate", help="e.g. ppl_ratio<=1.05."),
        json_: JsonOpt = False,
    ) -> None:
        """Measure quality against a reference and gate on regressions."""
        not_available("eval", 7)
