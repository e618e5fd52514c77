"""``llmctl serve`` (planned): OpenAI-compatible server on the built-in engine."""

from __future__ import annotations

import typer

from llmctl.cli.errors import guarded, not_available
from llmctl.cli.options import ModelArg


def register(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def serve(
        model: ModelArg,
        host: str = typer.Option("127.0.0.1", "--host"),
        port: int = typer.Option(8000, "--port"),
        engine: str = typer.Option("llmctl", "--engine", help="llmctl | vllm | trtllm."),
        kv_cache_memory: str = typer.Option(None, "--kv-cache-memory",
                                            help="KV cache budget, e.g. 2GiB."),
        api_key: str = typer.Option(None, "--api-key", help="Require this bearer token."),
    ) -> None:
        """Serve a model over an OpenAI-compatible HTTP API."""
        not_available("serve", 5)
