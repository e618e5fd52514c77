"""``llmctl info``: what a model is, without loading its weights."""

from __future__ import annotations

from pathlib import Path

import typer

from llmctl.cli.errors import guarded
from llmctl.cli.options import JsonOpt, ModelArg


def _human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _render_model(info):
    from rich.table import Table

    def render(console) -> None:
        table = Table(show_header=False, box=None, pad_edge=False)
        table.add_column(style="bold")
        table.add_column()
        rows = [
            ("model", info.path),
            ("source", info.source),
            ("architecture", f"{info.architecture} ({info.model_type})"),
            ("parameters", f"{info.parameters:,}"),
            ("layers", str(info.layers)),
            ("hidden / ffn", f"{info.hidden_size} / {info.intermediate_size}"),
            ("heads / kv heads", f"{info.heads} / {info.kv_heads} (head dim {info.head_dim})"),
            ("vocab", f"{info.vocab_size:,}"),
            ("context length", f"{info.context_length:,}"),
            ("rope theta", str(info.rope_theta)),
            ("tied embeddings", str(info.tied_embeddings)),
            ("dtype", info.dtype),
            ("size on disk", _human_size(info.size_on_disk)),
            ("tokenizer", f"{info.tokenizer} (eos {info.eos_token})"),
            ("chat template", "yes" if info.chat_template else "no"),
            ("quantization", (info.quantization or {}).get("quant_method", "none")),
        ]
        for key, value in rows:
            table.add_row(key, value)
        console.print(table)

    return render


def _render_gguf(data, show_tensors: bool):
    from rich.table import Table

    def render(console) -> None:
        table = Table(show_header=False, box=None, pad_edge=False)
        table.add_column(style="bold")
        table.add_column(overflow="fold")
        for key, value in data["metadata"].items():
            text = str(value)
            table.add_row(key, text if len(text) < 120 else text[:117] + "...")
        types = ", ".join(f"{k} x{v}" for k, v in data["types"].items())
        table.add_row("tensors", f"{len(data['tensors'])} ({types})")
        table.add_row("parameters", f"{data['n_parameters']:,}")
        table.add_row("size on disk", _human_size(data["size"]))
        table.add_row("bits per weight", f"{data['bits_per_weight']:.2f}")
        console.print(table)
        if show_tensors:
            tensors = Table("name", "type", "shape", "bytes")
            for t in data["tensors"]:
                tensors.add_row(t["name"], t["type"], str(t["shape"]), f"{t['n_bytes']:,}")
            console.print(tensors)

    return render


def gguf_summary(path: Path) -> dict:
    from llmctl.gguf.summary import summarize_gguf

    return summarize_gguf(path)


def register(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def info(
        model: ModelArg,
        json_: JsonOpt = False,
        tensors: bool = typer.Option(False, "--tensors", help="GGUF: list every tensor."),
    ) -> None:
        """Show a model's architecture, size, tokenizer and quantization."""
        from llmctl.cli.output import Output

        out = Output(json_mode=json_)
        path = Path(model).expanduser()
        if path.is_file() and path.suffix.lower() == ".gguf":
            data = gguf_summary(path)
            out.result(data, _render_gguf(data, tensors))
            return
        from llmctl.models.info import model_info
        from llmctl.models.resolve import resolve_model

        with out.progress("converting model") as update:
            resolved = resolve_model(model, progress=update)
        info_ = model_info(resolved.path, resolved.source)
        out.result(info_.to_dict(), _render_model(info_))
