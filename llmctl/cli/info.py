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


def _feature_rows(f: dict) -> list[tuple[str, str]]:
    """The family's features worth showing, as table rows (what is off is left out)."""
    norms = f["norms"] + (" (1 + w)" if f["norm_offset"] else "")
    if f["qk_norm"]:
        norms += f", q/k norm per {f['qk_norm']}"
    attention = [f"scale {f['attention_scale']:.4g}" if f["attention_scale"] else None,
                 f"soft-cap {f['attn_softcap']:g}" if f["attn_softcap"] else None]
    rope = f["rope"]
    rope_text = f"{rope['type']}, theta {rope['theta']:g}" if rope and rope["theta"] else ""
    if f["partial_rotary_factor"] != 1.0:
        rope_text += f", {f['partial_rotary_factor']:g} of each head"
    if f["local_rope"]:
        rope_text += (f"; sliding layers {f['local_rope']['type']}, theta "
                      f"{f['local_rope']['theta']:g}")
    scales = [f"{k.replace('_', ' ')} {f[k]:g}" for k in
              ("embedding_multiplier", "residual_multiplier", "logits_scaling") if f[k] != 1.0]
    if f["final_softcap"]:
        scales.append(f"final soft-cap {f['final_softcap']:g}")
    rows = [("norms", norms), ("activation", f["activation"]),
            ("attention", ", ".join(a for a in attention if a) or "standard"),
            ("rope", rope_text or "-")]
    if f["sliding_windows"]:
        sizes = ", ".join(map(str, f["sliding_windows"]))
        pattern = f"{sizes} tokens, layers {f['window_pattern']} (S sliding, F full)"
        rows.append(("sliding windows", pattern))
    if scales:
        rows.append(("scales", ", ".join(scales)))
    if f["fused_projections"]:
        rows.append(("fused projections", ", ".join(f["fused_projections"])))
    return rows


def _footprint_rows(fp: dict | None, layers: int) -> list[tuple[str, str]]:
    if fp is None:
        return []
    kv = f"{_human_size(fp['kv_bytes_context'])} at {fp['context']:,} tokens"
    if fp["sliding_layers"]:
        kv += f" ({fp['sliding_layers']} of {layers} layers hold at most their window)"
    return [("parameters (config)", f"{fp['parameters']:,}"),
            (f"weights ({fp['weight_format']})", _human_size(fp["weight_bytes"])),
            (f"KV per token ({fp['kv_dtype']})", f"{fp['kv_bytes_per_token'] / 1024:.1f} KiB"),
            ("KV of one sequence", kv)]


def _render_model(info, fp: dict | None = None):
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
            *_footprint_rows(fp, info.layers),
            *_feature_rows(info.features),
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
        fp = _footprint(resolved.path)
        out.result({**info_.to_dict(), "footprint": fp}, _render_model(info_, fp))


def _footprint(path: Path) -> dict | None:
    """Sizes from config.json (:mod:`llmctl.perf.footprint`); None where the cost model
    does not describe the architecture."""
    import json

    from llmctl.errors import LlmctlError
    from llmctl.perf.footprint import footprint

    try:
        return footprint(json.loads((path / "config.json").read_text())).to_dict()
    except LlmctlError:
        return None
