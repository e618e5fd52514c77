"""``llmctl quantize``: GPTQ, AWQ, FP8, INT8 and RTN from YAML recipes (and GGUF)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmctl.cli.errors import guarded
from llmctl.cli.options import Device, JsonOpt, ModelArg, ThreadsOpt


def _is_gguf(format_: str, recipe: str | None) -> bool:
    if format_ == "gguf":
        return True
    if format_ != "compressed-tensors":
        from llmctl.errors import UsageError

        raise UsageError(f"unknown output format {format_!r}", "use compressed-tensors or gguf")
    if recipe:
        from llmctl.quant.recipe import recipe_format

        return recipe_format(recipe) == "gguf"
    return False


def _gguf(model: str, output: str | None, recipe: str | None, calibration: str | None,
          gguf_type: str | None, imatrix: str | None, dry_run: bool, threads: int | None, out) -> None:
    """Hand over to the GGUF exporter (llmctl.gguf.export.quantize_to_gguf)."""
    import inspect

    from llmctl.errors import NotAvailableYet, UsageError

    try:
        from llmctl.gguf.export import quantize_to_gguf
    except ImportError:
        raise NotAvailableYet("GGUF export is not available yet",
                              "use --format compressed-tensors; GGUF export is issue #8") from None
    from llmctl.models.resolve import resolve_model

    if not output and not dry_run:
        raise UsageError("--output is required", "pass -o model.gguf")
    # every family with a llama.cpp graph, gpt-oss too: what a graph cannot compute is
    # refused by the exporter (llmctl.gguf.families.check_exportable) before any work
    resolved = resolve_model(model)
    offered = {"model_dir": resolved.path, "out_path": Path(output) if output else None,
               "gguf_type": gguf_type, "recipe_overrides": recipe, "imatrix": imatrix,
               "calibration": calibration, "dry_run": dry_run, "threads": threads}
    accepted = inspect.signature(quantize_to_gguf).parameters
    kwargs = {k: v for k, v in offered.items() if k in accepted and v is not None}
    with out.progress("exporting GGUF") as update:
        if "progress" in accepted:
            kwargs["progress"] = update
        data = quantize_to_gguf(**kwargs)
    out.result(data)


def register(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def quantize(
        model: ModelArg,
        recipe: str = typer.Option(None, "--recipe", "-r",
                                   help="YAML recipe, or a name from recipes/ (e.g. w4a16-gptq)."),
        calibration: str = typer.Option(None, "--calibration", "-c",
                                        help="Calibration text: file, hf:NAME or built-in "
                                             "(default builtin:pydoc-calib)."),
        output: str = typer.Option(None, "--output", "-o", help="Output directory or .gguf."),
        format_: str = typer.Option("compressed-tensors", "--format",
                                    help="compressed-tensors | gguf."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan, run nothing."),
        samples: int = typer.Option(128, "--samples", help="Calibration windows."),
        seq_len: int = typer.Option(512, "--seq-len", help="Tokens per calibration window."),
        seed: int = typer.Option(0, "--seed", help="Seed for drawing calibration windows."),
        field: str = typer.Option("text", "--field", help="Text field of .jsonl/.parquet/hf: data."),
        chat_template: bool = typer.Option(False, "--chat-template",
                                           help="Format each document through the chat template."),
        strict_group_size: bool = typer.Option(
            False, "--strict-group-size",
            help="Fail when a group size does not divide a layer (default: use the largest "
                 "valid size below it)."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output."),
        device: Annotated[Device | None, typer.Option(
            "--device", help="cpu | cuda (default: cuda if present).")] = None,
        calib_dtype: str = typer.Option(
            "auto", "--calib-dtype",
            help="Dtype of calibration activations: auto | bfloat16 | float32 (auto: bfloat16 "
                 "on a GPU or a CPU with native bf16, else float32)."),
        threads: ThreadsOpt = None,
        calibrate_all_experts: bool = typer.Option(
            None, "--calibrate-all-experts/--no-calibrate-all-experts",
            help="Mixtures of experts: every calibration token through every expert for the "
                 "statistics (the output keeps the real routing); default: the recipe's "
                 "(on)."),
        gguf_type: str = typer.Option(None, "--type", help="GGUF file type, e.g. Q4_K_M (--format gguf)."),
        imatrix: str = typer.Option(None, "--imatrix", help="GGUF importance matrix: auto or a file."),
        json_: JsonOpt = False,
    ) -> None:
        """Quantize a model from a recipe into a checkpoint other tools load."""
        from llmctl.cli.output import Output
        from llmctl.errors import UsageError

        out = Output(json_)
        if _is_gguf(format_, recipe):
            _gguf(model, output, recipe, calibration, gguf_type, imatrix, dry_run, threads, out)
            return
        if not recipe:
            raise UsageError("--recipe is required", "pass e.g. --recipe w4a16-gptq (see recipes/)")
        import torch

        from llmctl.models.loading import torch_dtype
        from llmctl.quant.calibration import DEFAULT_SOURCE, CalibrationSpec
        from llmctl.quant.pipeline import PipelineOptions
        from llmctl.utils.device import resolve_calib_dtype, resolve_device

        if device is not None:  # unset: the pipeline takes CUDA when there is one
            device = resolve_device(device)
        if threads:
            torch.set_num_threads(threads)
        spec = CalibrationSpec(calibration or DEFAULT_SOURCE, field, samples, seq_len, seed,
                               chat_template)
        calib = resolve_calib_dtype(calib_dtype, device=device)
        options = PipelineOptions(compute_dtype=torch_dtype(calib.dtype), device=device,
                                  calibrate_all_experts=calibrate_all_experts)
        if dry_run:
            _dry_run(out, model, recipe, spec, options, strict_group_size)
            return
        if not output:
            raise UsageError("--output is required", "pass -o DIR for the quantized checkpoint")
        from llmctl.quant.run import QuantizeRequest
        from llmctl.quant.run import quantize as run_quantize

        request = QuantizeRequest(model, recipe, Path(output), spec, options, strict_group_size,
                                  overwrite)
        with out.progress("quantizing layers") as update:
            report = run_quantize(request, progress=update, warn=out.warn, status=out.status)
        out.result(_summary(report) if json_ else report, _render_report(report))


def _dry_run(out, model, recipe, spec, options, strict) -> None:
    from llmctl.quant.pipeline import needs_calibration
    from llmctl.quant.report import render_plan
    from llmctl.quant.run import DATA_FREE_REASON, memory_estimate, moe_summary, prepare

    prep = prepare(model, recipe, strict_group_size=strict)
    data_free = not needs_calibration(prep.plan, prep.recipe)
    estimate = memory_estimate(prep, None if data_free else spec, options)
    calibration = ({"data_free": True, "reason": DATA_FREE_REASON} if data_free else
                   {"source": spec.source, "samples": spec.samples, "seq_len": spec.seq_len})
    data = {"dry_run": True, "model": str(prep.path), "recipe": prep.recipe.path,
            "plan": prep.plan.to_dict(), "calibration": calibration,
            "memory_estimate": estimate.to_dict(), "experts": moe_summary(prep)}
    if data["experts"] is not None and options.calibrate_all_experts is not None:
        data["experts"]["calibrate_all_experts"] = options.calibrate_all_experts

    def render(console) -> None:
        render_plan(console, prep.plan)
        _render_experts(console, data["experts"])
        if data_free:
            console.print("calibration: none (round-to-nearest from the weights alone)")
        gib = 1 << 30
        console.print(f"peak memory estimate: {estimate.peak / gib:.2f} GiB "
                      f"({estimate.needed / gib:.2f} GiB for the run"
                      + (f", {estimate.available / gib:.1f} GiB available)" if estimate.available
                         else ")"))

    out.result(data, render)


def _render_experts(console, moe: dict | None) -> None:
    if moe is None:
        return
    console.print(f"mixture of experts: {moe['experts']} experts per layer, top-"
                  f"{moe['experts_per_token']}, in layers {moe['sparse_layers']}"
                  + (", plus a shared expert" if moe["shared_expert"] else "")
                  + "; each expert's linears quantized on their own")
    console.print(f"router kept in full precision (bit-identical, in the output's ignore): "
                  f"{len(moe['routers_kept'])} modules, e.g. {moe['routers_kept'][0]}")
    console.print("calibration per expert: " + (
        "every token through every expert for the statistics (calibrate_all_experts)"
        if moe["calibrate_all_experts"] else
        f"routed tokens only; fewer than {moe['min_expert_tokens']}: round-to-nearest"))


def _summary(report: dict) -> dict:
    """The JSON answer: the report without the per-linear detail (that is in the file)."""
    return {k: v for k, v in report.items() if k not in ("linears",)}


def _render_report(report: dict):
    from llmctl.quant.report import render_layers

    def render(console) -> None:
        render_layers(console, report["layers"])
        moe = report.get("experts")
        if moe:
            short = moe["under_calibrated"]
            layers = len({r["layer"] for r in moe["experts"]})
            how = ("from the weights alone" if report["calibration"].get("data_free") else
                   "each on its own statistics (calibrate_all_experts "
                   f"{'on' if moe['calibrate_all_experts'] else 'off'})")
            listed = ", ".join(short[:5]) + (f" and {len(short) - 5} more" if len(short) > 5
                                             else "")
            console.print(f"experts: {len(moe['experts'])} in {layers} sparse layers, {how}; "
                          f"router in full precision; under-calibrated: {listed or 'none'}")
        mib = 1 << 20
        sizes, times, calib = report["sizes"], report["timings"], report["calibration"]
        data = "no calibration" if calib.get("data_free") else f"calibration {calib['tokens']:,} tokens"
        console.print(f"[bold]{report['method']}[/bold] -> {report['output']} "
                      f"({report['format']}): {sizes['before_bytes'] / mib:,.1f} MiB -> "
                      f"{sizes['after_bytes'] / mib:,.1f} MiB in {times['total_seconds']:.1f} s "
                      f"({data}, "
                      f"{report['device']}{', emulated arithmetic' if report['emulated'] else ''})")

    return render
