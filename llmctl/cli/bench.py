"""``llmctl bench`` (planned): latency/throughput harness for OpenAI-compatible servers."""

from __future__ import annotations

import typer

from llmctl.cli.errors import guarded, not_available


def register(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def bench(
        model: str = typer.Option(None, "--model", "-m", help="Model name or reference."),
        target: str = typer.Option(None, "--target", help="Base URL of the server."),
        num_prompts: int = typer.Option(100, "--num-prompts"),
        request_rate: str = typer.Option("inf", "--request-rate", help="Requests/s or inf."),
        max_concurrency: int = typer.Option(None, "--max-concurrency"),
        slo: list[str] = typer.Option(None, "--slo", help="e.g. ttft_ms=500 (repeatable)."),
        gate: list[str] = typer.Option(None, "--gate", help="e.g. p99_ttft_ms<=500."),
    ) -> None:
        """Measure TTFT, TPOT, ITL, E2E latency and throughput of an endpoint."""
        not_available("bench", 6)
