"""One quantization run end to end: resolve, plan, calibrate, check memory, execute, write.

The output directory is built under a temporary name and renamed at the end, so an
interrupted run (Ctrl-C, an exception, a kill) never leaves a directory that looks like
a finished checkpoint.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmctl.quant.calibration import CalibrationSpec
from llmctl.quant.pipeline import PipelineOptions
from llmctl.quant.plan import QuantPlan

REPORT_FILE = "llmctl-quant.json"
RECIPE_FILE = "recipe.yaml"
DATA_FREE_REASON = ("round-to-nearest weights with dynamic or no activation quantization "
                    "and no KV-cache scales read no data (rel_error is the weights' own)")


@dataclass
class Prepared:
    reference: str
    path: Path
    ckpt: Any
    recipe: Any
    plan: QuantPlan


@dataclass
class QuantizeRequest:
    model: str
    recipe: str
    output: Path
    calibration: CalibrationSpec = field(default_factory=CalibrationSpec)
    options: PipelineOptions = field(default_factory=PipelineOptions)
    strict_group_size: bool = False
    overwrite: bool = False


def prepare(model: str, recipe: str, *, strict_group_size: bool = False) -> Prepared:
    from llmctl.models.resolve import resolve_model
    from llmctl.quant.checkpoint import Checkpoint
    from llmctl.quant.plan import build_plan
    from llmctl.quant.recipe import load_recipe

    resolved = resolve_model(model)
    ckpt = Checkpoint(resolved.path)
    from llmctl.models.architectures import get_architecture

    get_architecture(ckpt.config.get("model_type", ""))
    parsed = load_recipe(recipe)
    plan = build_plan(ckpt, parsed, strict_group_size=strict_group_size)
    plan.smoothing = smoothing_plan(ckpt, parsed)
    return Prepared(model, resolved.path, ckpt, parsed, plan)


def smoothing_plan(ckpt, recipe) -> list[str] | None:
    """What the recipe's smoothing method folds in a layer of this model (None: none)."""
    from llmctl.models.spec import ModelArch
    from llmctl.quant import block
    from llmctl.quant.methods import methods_for
    from llmctl.quant.moe_smoothing import EXPERT_FOLD, folds_experts
    from llmctl.quant.smoothing import describe

    smoother = methods_for(recipe).smoother
    if smoother is None:
        return None
    shape = block.BlockShape.from_arch(ModelArch.from_config(ckpt.config))
    sparse = next((s for s in shape.layer_moe if s is not None), None)
    experts = sparse is not None and folds_experts(smoother, shape)
    return describe(smoother, shape) + ([EXPERT_FOLD] if experts else [])


def moe_summary(prep: Prepared) -> dict[str, Any] | None:
    """What the dry run says of a mixture of experts (None for a dense model): experts per
    layer, which layers are sparse, the routers kept in full precision, the calibration."""
    from llmctl.models.spec import ModelArch
    from llmctl.quant.plan import ROUTER_KINDS

    arch = ModelArch.from_config(prep.ckpt.config)
    if not any(arch.moe_layers):
        return None
    modifier = prep.recipe.weight_modifier
    return {"experts": arch.num_experts, "experts_per_token": arch.experts_per_token,
            "sparse_layers": [i for i, s in enumerate(arch.moe_layers) if s],
            "shared_expert": arch.shared_expert_intermediate_size > 0,
            "routers_kept": [m.name for m in prep.plan.modules if m.kind in ROUTER_KINDS],
            "calibrate_all_experts": modifier.calibrate_all_experts,
            "min_expert_tokens": modifier.min_expert_tokens}


def memory_estimate(prep: Prepared, calib: CalibrationSpec | None, options: PipelineOptions):
    """Peak memory of the run; ``calib`` None: a data-free run (no activations)."""
    from llmctl.models.spec import ModelArch
    from llmctl.quant import block, memory
    from llmctl.quant.methods import methods_for

    methods = methods_for(prep.recipe)
    arch = ModelArch.from_config(prep.ckpt.config)
    shape = block.BlockShape.from_arch(arch)
    prefix = "model.layers.0."
    layer_params = sum(_numel(prep.ckpt.shape(n)) for n in prep.ckpt.names() if n.startswith(prefix))
    uses_h = methods.keeps_hessians
    inter = arch.intermediate_size
    dims = [shape.hidden, shape.heads * shape.head_dim, shape.hidden, inter] if uses_h else []
    if uses_h and any(arch.moe_layers):
        # a mixture's tap holds one X^T X per expert at once (the gate/up one shared by
        # every expert under calibrate_all_experts) and the shared expert's
        all_experts = prep.recipe.weight_modifier.calibrate_all_experts \
            if options.calibrate_all_experts is None else options.calibrate_all_experts
        shared = [arch.shared_expert_intermediate_size] * (arch.shared_expert_intermediate_size > 0)
        dims += ([shape.hidden] * (1 if all_experts else arch.num_experts)
                 + [arch.expert_intermediate_size] * arch.num_experts + shared)
    rows = max((shape.heads + 2 * shape.kv_heads) * shape.head_dim, 2 * inter, shape.hidden)
    compute_bytes = 2 if str(options.compute_dtype).endswith(("bfloat16", "float16")) else 4
    return memory.estimate(arch, samples=calib.samples if calib else 0,
                           seq_len=calib.seq_len if calib else 1,
                           compute_bytes=compute_bytes,
                           chunk_tokens=options.chunk_tokens if calib else 0,
                           layer_params=layer_params, hessian_dims=dims, max_rows=rows,
                           smoothing=methods.smoother is not None)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def quantize(request: QuantizeRequest, *, progress: Callable[[int, int], None] | None = None,
             warn: Callable[[str], None] | None = None,
             status: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the request and return the report that is also written as llmctl-quant.json."""
    import torch

    from llmctl.models.loading import load_tokenizer
    from llmctl.quant import memory
    from llmctl.quant.calibration import build_calibration
    from llmctl.quant.pipeline import LayerQuantizer, needs_calibration
    from llmctl.quant.report import per_layer_rows
    from llmctl.quant.writer import copy_side_files, write_config
    from llmctl.report import run_metadata
    from llmctl.utils.atomic import atomic_dir

    say = status or (lambda message: None)
    started = time.perf_counter()
    output = Path(request.output)
    if output.exists() and not request.overwrite:
        raise FileExistsError(output)
    prep = prepare(request.model, request.recipe, strict_group_size=request.strict_group_size)
    for note in prep.plan.warnings:
        (warn or say)(note)
    calib = None
    if needs_calibration(prep.plan, prep.recipe):
        say(f"calibration: {request.calibration.samples} x {request.calibration.seq_len} "
            f"tokens from {request.calibration.source}")
        calib = build_calibration(load_tokenizer(prep.path), request.calibration)
    else:
        say("calibration: none (round-to-nearest from the weights alone)")
    estimate = memory_estimate(prep, request.calibration if calib else None, request.options)
    memory.check(estimate)
    calib_seconds = time.perf_counter() - started
    quantizer = LayerQuantizer(prep.ckpt, prep.plan, prep.recipe, calib, request.options, warn=warn)
    device = str(quantizer.device)
    # No FP8 / int8-activation kernels run here: both are emulated by quantize-dequantize.
    emulated = device == "cpu" and any(m.weight.type == "float" or m.act is not None
                                       for m in prep.plan.quantized)
    say(f"quantizing {prep.plan.method} on {device}"
        + (" (FP8 / int8 activation arithmetic emulated in float32)" if emulated else ""))
    with atomic_dir(output, overwrite=request.overwrite) as tmp:
        result = quantizer.run(tmp, progress)
        write_config(tmp, prep.ckpt.config, prep.plan)
        side_files = copy_side_files(prep.path, tmp)
        if prep.recipe.source is not None:
            (tmp / RECIPE_FILE).write_text(prep.recipe.source)
        linears = [r.to_dict() for r in result.linears]
        report = {
            "method": prep.plan.method,
            "format": prep.plan.format,
            "model": {"reference": request.model, "path": str(prep.path),
                      "dtype": prep.plan.dtype},
            "output": str(output),
            "recipe": {"file": prep.recipe.path, "saved_as": RECIPE_FILE,
                       **prep.recipe.to_dict()},
            "calibration": calib.to_dict() if calib else {"data_free": True,
                                                           "reason": DATA_FREE_REASON},
            "plan": prep.plan.to_dict(),
            "sizes": {"before_bytes": prep.plan.bytes_before,
                      "after_bytes": sum((tmp / f).stat().st_size for f in result.files),
                      "expected_bytes": prep.plan.bytes_after},
            "timings": {"total_seconds": time.perf_counter() - started,
                        "calibration_seconds": calib_seconds,
                        "quantize_seconds": result.seconds,
                        "layer_seconds": result.layer_seconds},
            "emulated": emulated,
            "device": device,
            "compute_dtype": str(request.options.compute_dtype).replace("torch.", ""),
            "memory_estimate": estimate.to_dict(),
            "peak_rss_bytes": _peak_rss(),
            "layers": per_layer_rows(linears, result.layer_seconds),
            "linears": linears,
            "experts": moe_report(result.experts, quantizer),
            "warnings": prep.plan.warnings + result.warnings,
            "files": result.files + side_files + ["config.json", REPORT_FILE],
            "metadata": run_metadata(command="quantize", torch_threads=torch.get_num_threads()),
        }
        # Written last: its presence marks a finished output.
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=2, default=str))
    return report


def moe_report(rows: list[dict], quantizer) -> dict[str, Any] | None:
    """The per-expert section of llmctl-quant.json (None for a dense model): each
    layer's experts with the calibration tokens routed to them, the tokens their
    statistics saw, each linear's error, and the experts quantized round-to-nearest for
    want of tokens."""
    if not rows:
        return None
    return {"calibrate_all_experts": quantizer.all_experts,
            "min_expert_tokens": quantizer.min_expert_tokens,
            "router": "full precision (bit-identical to the input)",
            "experts": rows,
            "under_calibrated": [r["module"] for r in rows if r["under_calibrated"]]}


def _peak_rss() -> int | None:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except (ImportError, OSError):
        return None
