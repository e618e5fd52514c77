"""``llmctl build-engine`` (planned): ONNX Runtime, TensorRT-LLM, torch.compile."""

from __future__ import annotations

import typer

from llmctl.cli.errors import guarded, not_available
from llmctl.cli.options import JsonOpt, ModelArg


def register(app: typer.Typer) -> None:
    @app.command("build-engine")
    @guarded
    def build_engine(
        model: ModelArg,
        target: str = typer.Option(None, "--target", "-t",
                                   help="onnx | tensorrt-llm | torch-compile."),
        output: str = typer.Option(None, "--output", "-o", help="Engine directory."),
        precision: str = typer.Option("fp32", "--precision", help="fp32 | fp16 | int4."),
        json_: JsonOpt = False,
    ) -> None:
        """Compile a model into an engine for a runtime."""
        not_available("build-engine", 9)
