"""The human side of a run: the dry-run plan and the per-layer result table."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from rich.console import Console
from rich.table import Table

from llmctl.quant.plan import QuantPlan

MIB = 1 << 20


def _mib(n: int) -> str:
    return f"{n / MIB:,.1f}"


def per_layer_rows(linears: list[dict[str, Any]], layer_seconds: list[float]) -> list[dict[str, Any]]:
    """One row per decoder layer (and lm_head): error, time, size before/after."""
    groups: dict[Any, list[dict]] = defaultdict(list)
    for row in linears:
        groups[row["layer"]].append(row)
    rows = []
    for layer in sorted(groups, key=lambda k: (k is None, k if k is not None else 0)):
        items = groups[layer]
        losses = [r["gptq_loss"] for r in items if r.get("gptq_loss") is not None]
        rows.append({
            "layer": "lm_head" if layer is None else layer,
            "linears": len(items),
            "mean_rel_error": sum(r["rel_error"] for r in items) / len(items),
            "max_rel_error": max(r["rel_error"] for r in items),
            "gptq_loss": sum(losses) if losses else None,
            "seconds": (layer_seconds[layer] if layer is not None and layer < len(layer_seconds)
                        else sum(r["seconds"] for r in items)),
            "bytes_before": sum(r["bytes_before"] for r in items),
            "bytes_after": sum(r["bytes_after"] for r in items),
        })
    return rows


def render_layers(console: Console, rows: list[dict[str, Any]]) -> None:
    table = Table(title="per-layer quantization", title_justify="left")
    for col in ("layer", "linears", "mean rel err", "max rel err", "GPTQ loss", "time s",
                "MiB before", "MiB after"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["layer"]), str(r["linears"]), f"{r['mean_rel_error']:.4f}",
                      f"{r['max_rel_error']:.4f}",
                      "-" if r["gptq_loss"] is None else f"{r['gptq_loss']:.4g}",
                      f"{r['seconds']:.1f}", _mib(r["bytes_before"]), _mib(r["bytes_after"]))
    console.print(table)


def render_plan(console: Console, plan: QuantPlan, *, show_all: bool = True) -> None:
    table = Table(title=f"quantization plan ({plan.method}, {plan.format})", title_justify="left")
    table.add_column("module", no_wrap=True)
    for col in ("shape", "weights", "activations", "format", "MiB before", "MiB after", "note"):
        table.add_column(col, justify="right" if col.startswith("MiB") else "left")
    for m in plan.modules:
        if not show_all and not m.quantized:
            continue
        table.add_row(m.name, f"{m.out_features}x{m.in_features}",
                      m.weight.label() if m.weight else "float (kept)",
                      m.act.label() if m.act else "-", m.format if m.quantized else "dense",
                      _mib(m.bytes_before), _mib(m.bytes_after), m.note)
    console.print(table)
    ratio = plan.bytes_before / max(plan.bytes_after, 1)
    console.print(f"expected size: {_mib(plan.bytes_after)} MiB (from {_mib(plan.bytes_before)} MiB, "
                  f"{ratio:.2f}x smaller); ignored: {', '.join(plan.ignore) or 'none'}")
    if plan.smoothing is not None:
        console.print("smoothing folds, in every layer: " + (
            "; ".join(plan.smoothing) or "nothing (no norm or linear here can absorb scales)"))
    for warning in plan.warnings:
        console.print(f"[yellow]note:[/yellow] {warning}")
