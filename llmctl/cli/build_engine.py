"""``llmctl build-engine``: ONNX Runtime, TensorRT-LLM and torch.compile (AOTInductor)."""

from __future__ import annotations

from typing import Annotated

import typer

from llmctl.cli.errors import guarded
from llmctl.cli.options import Device, JsonOpt, ModelArg

_TARGETS = "onnx | torch-compile | tensorrt-llm"


def register(app: typer.Typer) -> None:
    @app.command("build-engine")
    @guarded
    def build_engine(
        model: ModelArg,
        target: str = typer.Option(..., "--target", "-t", help=_TARGETS + "."),
        output: str = typer.Option(..., "--output", "-o", help="Engine directory to create."),
        precision: str | None = typer.Option(
            None, "--precision",
            help="onnx: fp32 | fp16 (cuda) | int4 | int8; torch-compile: fp32 | bf16 | fp16; "
                 "tensorrt-llm: auto | bf16 | fp16 | fp32. Default: the target's first."),
        device: Annotated[Device, typer.Option(
            "--device", help="cpu | cuda (what the engine is built to run on).")] = "cpu",
        max_batch_size: int = typer.Option(16, "--max-batch-size",
                                           help="Largest decode batch the engine takes "
                                                "(1-4096)."),
        max_seq_len: int | None = typer.Option(None, "--max-seq-len", min=16,
                                                  help="Longest sequence (prompt + output)."),
        option: list[str] | None = typer.Option(
            None, "--option", "-O", help="Target option KEY=VALUE (repeatable), e.g. "
                                         "block_size=64, isa=x86-64-v3, speculative=ngram."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing "
                                                                  "output directory."),
        json_: JsonOpt = False,
    ) -> None:
        """Compile a model into an engine directory for a runtime (with a manifest)."""
        from pathlib import Path

        from llmctl.cli.output import Output
        from llmctl.engines.builder import build_engine as build
        from llmctl.engines.options import CommonOptions, parse_pairs

        out = Output(json_mode=json_)
        common = CommonOptions(precision=precision, device=device,
                               max_batch_size=max_batch_size, max_seq_len=max_seq_len)
        with out.progress("converting model") as update:
            manifest = build(model, target, Path(output), common=common,
                             options=parse_pairs(option), overwrite=overwrite,
                             log=out.status, progress=update)
        size = sum(f.size for f in manifest.files.values())
        data = {"engine": str(Path(output)), "target": manifest.target,
                "precision": manifest.precision, "source": manifest.source.reference,
                "source_sha256": manifest.source.sha256, "seconds": manifest.build.seconds,
                "bytes": size, "tool": manifest.build.tool,
                "requirements": manifest.requirements.model_dump(exclude_defaults=True),
                "serve_command": manifest.serve_command, "notes": manifest.notes}

        def render(console) -> None:
            console.print(f"[bold]{manifest.target}[/bold] engine ({manifest.precision}) "
                          f"written to {output}: {size / 1e6:.1f} MB in "
                          f"{manifest.build.seconds:.1f} s with {manifest.build.tool}")
            console.print(f"serve it: {manifest.serve_command}")
            for note in manifest.notes:
                console.print(f"[dim]note: {note}[/dim]")

        out.result(data, render)
