"""``llmctl plan MODEL --hardware h100-80gb``: memory, TTFT and TPOT from the config alone.

Exit codes: 0 the model fits (and meets every --slo); 1 it does not fit or misses an SLO
(the suggestions say what would change that); 2 a bad option (unknown hardware or weight
format, a malformed --slo, tp or context below 1, no probed peaks for ``--hardware this``).
The arithmetic is in :mod:`llmctl.perf.plan`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import typer

from llmctl.cli.errors import guarded
from llmctl.cli.options import JsonOpt, ModelArg

Opt = typer.Option
Hardware = Annotated[str, Opt("--hardware", "-H", show_default=False, help=(
    "A GPU from the datasheet table (h100-80gb, h100-pcie, h200, a100-40gb, a100-80gb, l4, "
    "l40s, a10g, mi300x) or 'this' (the peaks `llmctl hw probe` measured here)."))]
Tp = Annotated[int, Opt("--tp", min=1, help="Tensor-parallel degree (GPUs per replica).")]
Weights = Annotated[str | None, Opt("--weights", show_default=False, help=(
    "fp32 | bf16 | fp16 | fp8 | int8 | w8a16 | w4a16[-gN] (default: the checkpoint's "
    "quantization_config, else bf16)."))]
KvDtype = Annotated[Literal["bf16", "fp16", "fp8", "int8", "fp32"],
                    Opt("--kv-dtype", help="KV cache element type.")]
Context = Annotated[int, Opt("--context", min=1, help="Tokens per sequence (prompt + output): "
                             "KV capacity is counted in sequences of this length, and TPOT "
                             "with every sequence this long.")]
PromptLen = Annotated[int | None, Opt("--prompt-len", min=1, show_default=False,
                                      help="Prompt tokens for TTFT (default min(1024, context)).")]
Slo = Annotated[str | None, Opt("--slo", show_default=False,
                                help="e.g. 'p95_ttft_ms<=500,p95_tpot_ms<=100'.")]
PeakFlops = Annotated[float | None, Opt("--peak-flops", show_default=False, help=(
    "Peak FLOP/s of the products (for the weights' compute dtype), replacing the table's."))]
PeakBandwidth = Annotated[float | None, Opt("--peak-bandwidth", show_default=False,
                                            help="Peak memory bandwidth in bytes/s.")]
MemoryGb = Annotated[float | None, Opt("--memory-gb", show_default=False,
                                       help="Device memory in GB (1e9 bytes).")]
Utilization = Annotated[float, Opt("--gpu-memory-utilization", min=0.01, max=1.0,
                                   help="Share of memory the engine may use (vLLM's default).")]
ComputeEff = Annotated[float | None, Opt("--compute-efficiency", min=0.01, max=1.0,
                                         show_default=False,
                                         help="Attained share of the FLOP/s peak.")]
BandwidthEff = Annotated[float | None, Opt("--bandwidth-efficiency", min=0.01, max=1.0,
                                           show_default=False,
                                           help="Attained share of the bandwidth peak.")]
LayerOverhead = Annotated[float | None, Opt("--overhead-us-per-layer", min=0.0,
                                            show_default=False,
                                            help="Fixed microseconds per layer per step.")]


def register(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def plan(
        model: ModelArg,
        hardware: Hardware,
        tp: Tp = 1,
        weights: Weights = None,
        kv_dtype: KvDtype = "bf16",
        context: Context = 8192,
        prompt_len: PromptLen = None,
        slo: Slo = None,
        peak_flops: PeakFlops = None,
        peak_bandwidth: PeakBandwidth = None,
        memory_gb: MemoryGb = None,
        gpu_memory_utilization: Utilization = 0.9,
        compute_efficiency: ComputeEff = None,
        bandwidth_efficiency: BandwidthEff = None,
        overhead_us_per_layer: LayerOverhead = None,
        json_: JsonOpt = False,
    ) -> None:
        """Will MODEL fit on this hardware, and how fast can it be? From config.json alone."""
        from dataclasses import replace

        from llmctl.cli.errors import usage_errors
        from llmctl.cli.output import Output
        from llmctl.perf import plan as planning
        from llmctl.perf.arch import ArchSpec
        from llmctl.perf.model_config import load_model_config
        from llmctl.perf.weight_format import WeightFormat

        out = Output(json_)
        with usage_errors():
            options = planning.PlanOptions(
                tp=tp, context=context, prompt_len=prompt_len, kv_dtype=kv_dtype,
                gpu_memory_utilization=gpu_memory_utilization,
                slos=planning.parse_slos(slo))
            fmt = WeightFormat.from_name(weights) if weights else None
            peaks, efficiency = _hardware(hardware)
        config, source = load_model_config(model)
        arch = ArchSpec.from_config(config)
        notes = []
        if fmt is None:
            fmt = WeightFormat.from_config(config)
            if "GGUF" in source:
                notes.append("a GGUF is planned as its bf16 checkpoint; pass --weights for a "
                             "quantized serving format")
        elif config.get("quantization_config"):
            notes.append(f"--weights {fmt.name} replaces the checkpoint's quantization_config")
        peaks = peaks.with_overrides(flops=peak_flops, dtype=fmt.compute_dtype,
                                     bandwidth=peak_bandwidth)
        if memory_gb is not None:
            peaks = replace(peaks, memory_bytes=int(memory_gb * 1e9),
                            source=f"{peaks.source}; override: memory {memory_gb:g} GB")
        changed = {k: v for k, v in (("compute", compute_efficiency),
                                      ("bandwidth", bandwidth_efficiency)) if v is not None}
        if overhead_us_per_layer is not None:
            changed["per_layer_s"] = overhead_us_per_layer * 1e-6
        if changed:
            given = ", ".join(f"{k}={v:g}" for k, v in changed.items())
            efficiency = replace(efficiency, **changed,
                                 basis=f"{efficiency.basis}; overridden: {given}")
        with usage_errors():
            result = planning.make_plan(arch, fmt, peaks, options, efficiency)
        data = {"model_reference": model, "config_source": source, **result.to_dict()}
        data["notes"] = [*data["notes"], *notes]
        out.result(data, lambda console: _render(console, model, source, result, notes))
        if not result.ok:
            raise typer.Exit(1)


def _hardware(name: str):
    """(peaks, efficiency model) of ``--hardware``."""
    from llmctl.perf import plan as planning

    if name.strip().lower() != "this":
        from llmctl.perf.devices import device_peaks

        return device_peaks(name), planning.DATASHEET
    from llmctl.errors import UsageError
    from llmctl.perf.probe_record import cached_peaks

    peaks = cached_peaks()
    if peaks is None:
        raise UsageError("no measured peaks for this machine",
                         "run `llmctl hw probe` first")
    return peaks, planning.CPU_PROBED


def _ms(seconds: float) -> str:
    """Milliseconds with three significant digits (0.142, 14.5, 1450)."""
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:,.0f}"


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if abs(n) >= 1e8 else f"{n / 1e6:.1f} MB"


def _window_detail(p) -> str:
    """How sliding-window layers enter KV per token: the average over one sequence."""
    windows = [w for w in p.arch.layer_windows if w is not None]
    if not windows:
        return ""
    return (f" (average over {p.options.context} tokens; {len(windows)} of "
            f"{p.arch.num_layers} layers hold at most {max(windows)})")


def _render(console, model: str, source: str, p, extra_notes: list[str]) -> None:
    from rich.markup import escape
    from rich.table import Table

    m, o, eff = p.memory, p.options, p.efficiency
    console.print(f"[bold]{model}[/bold] ({source}): {p.arch.model_type}, "
                  f"{p.cost.total_params / 1e9:.2f}B parameters"
                  + (f", {p.arch.num_experts} experts ({p.arch.experts_per_token} per token)"
                     if p.arch.is_moe else ""))
    console.print(f"weights {p.weights.describe()}; KV cache {o.kv_dtype}; tp {o.tp}")
    flops = p.peaks.flops_for(p.compute_dtype)
    console.print(f"hardware: {p.peaks.source}; {p.compute_dtype} {flops / 1e12:.3g} TFLOP/s, "
                  f"{p.peaks.bandwidth / 1e9:.4g} GB/s")

    mem = Table(title="Memory per device", show_header=False)
    mem.add_column("what")
    mem.add_column("value", justify="right")
    mem.add_row("device memory", _fmt_bytes(m.device_bytes))
    mem.add_row(f"engine budget (gpu-memory-utilization {m.utilization:g})",
                _fmt_bytes(m.budget_bytes))
    mem.add_row("weights", _fmt_bytes(m.weight_bytes))
    mem.add_row("activation workspace (estimate)", _fmt_bytes(m.activation_bytes))
    mem.add_row("left for the KV cache", _fmt_bytes(m.kv_budget_bytes))
    mem.add_row("KV per token" + _window_detail(p), f"{m.kv_bytes_per_token / 1024:.1f} KiB")
    mem.add_row("KV capacity", f"{m.kv_capacity_tokens:,} tokens")
    mem.add_row(f"sequences of {o.context} tokens at once", str(m.max_concurrency))
    console.print(mem)
    verdict = "[green]fits[/green]" if m.fits else "[bold red]does not fit[/bold red]"
    console.print(f"memory: {verdict}")

    f = p.prefill
    console.print(f"TTFT, {o.prompt}-token prompt ({p.prefill_chunks} chunk(s)): "
                  f"[bold]{_ms(f.seconds)} ms[/bold], {f.bound}-bound (compute "
                  f"{_ms(f.compute_s)} ms, memory {_ms(f.memory_s)} ms, fixed "
                  f"{_ms(f.overhead_s)} ms)")
    dec = Table(title=f"Decode step, every sequence at {o.context} tokens")
    for col in ("batch", "TPOT ms", "output tok/s", "bound", "compute ms", "memory ms",
                "fixed ms"):
        dec.add_column(col, justify="right")
    for r in p.decode:
        s = r.step
        dec.add_row(str(r.batch), _ms(s.seconds), f"{r.output_tokens_per_s:,.0f}", s.bound,
                    _ms(s.compute_s), _ms(s.memory_s), _ms(s.overhead_s))
    console.print(dec)
    how = "max(compute, memory)" if eff.overlap else "compute + memory"
    console.print(f"estimate = {how} + fixed; efficiency compute {eff.compute:g}, bandwidth "
                  f"{eff.bandwidth:g}, {eff.per_layer_s * 1e6:g} us/layer: {eff.basis}",
                  style="dim")
    if p.slo is not None:
        state = "[green]met[/green]" if p.slo.met else "[bold red]missed[/bold red]"
        line = f"SLOs {', '.join(s.text for s in o.slos)}: {state}"
        if p.slo.max_batch:
            line += (f"; TPOT holds up to batch {p.slo.max_batch} "
                     f"({p.slo.output_tokens_per_s:,.0f} output tok/s)")
        if p.slo.failed:
            line += f"; failing: {', '.join(p.slo.failed)}"
        console.print(line)
    if p.suggestions:
        console.print("[bold]suggestions[/bold]")
        for s in p.suggestions:
            mark = "[green]✓[/green]" if s.fixes else "·"
            console.print(f"  {mark} {escape(s.text)}")
    for note in (*p.notes, *extra_notes):
        console.print(f"note: {escape(note)}", style="dim")
