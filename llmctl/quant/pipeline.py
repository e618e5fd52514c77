"""Layer-by-layer quantization: one decoder layer in memory at a time.

For each layer the calibration activations (the residual stream ``X`` of every
calibration token, as produced by the *already quantized* layers before it) flow
through the layer stage by stage (``stream``), and each linear is quantized as soon as
its input is known:

    attn_in  = norm1(X)          -> q, k, v quantized (fused: one Hessian for the three)
    attn_out = attention(...)    -> o quantized           (q, k, v already quantized)
    X += o(attn_out); mlp_in = norm2(X) -> gate, up quantized
    mlp_act = silu(gate) * up    -> down quantized
    X += down(mlp_act)           -> the next layer's input

so each tap's statistics see the inputs the quantized model really produces ("true
sequential" in the GPTQ paper), every matmul of the forward runs once, and the layer's
output is propagated with quantized weights and emulated activation quantization. A
recipe with a smoothing method first runs the layer once in float (``smoothing``).

Which statistics a tap collects, the smoothing scales and the weights' codes come from
the recipe's methods (``method``, ``methods``): this module names none of them.

Peak memory is one layer plus the calibration activations (see ``memory``): weights
are read from memory-mapped safetensors per layer and written out before the next.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmctl.models.spec import ModelArch
from llmctl.quant import block, vllm_gpt_oss
from llmctl.quant.calibration import CalibrationSet
from llmctl.quant.checkpoint import Checkpoint
from llmctl.quant.fp8 import kv_cache_scales
from llmctl.quant.method import WeightJob, WeightResult
from llmctl.quant.methods import methods_for
from llmctl.quant.moe_smoothing import smooth_experts
from llmctl.quant.plan import ModulePlan, QuantPlan, WeightSpec, kv_heads
from llmctl.quant.recipe import Recipe
from llmctl.quant.scheme import act_quantizer, dequantize, weight_grid
from llmctl.quant.smoothing import Smoothed, smooth_layer
from llmctl.quant.stats import NOTHING, ExpertStats, Needs, TapStats
from llmctl.quant.stream import LayerStream
from llmctl.quant.writer import (
    PlannedWriter,
    QuantizedLinear,
    TensorSpec,
    module_tensor_specs,
    module_tensors,
)


def _auto_compute_dtype() -> torch.dtype:
    from llmctl.utils.device import resolve_calib_dtype

    return getattr(torch, resolve_calib_dtype("auto").dtype)


@dataclass
class PipelineOptions:
    # calibration activations: bf16 where it is native (GPU, AVX512-BF16/AMX), else float32
    compute_dtype: torch.dtype = field(default_factory=_auto_compute_dtype)
    chunk_tokens: int = 4096
    device: str | None = None
    max_shard_bytes: int = 2 << 30
    # a mixture of experts' calibrate_all_experts; None: the recipe's
    calibrate_all_experts: bool | None = None


def needs_calibration(plan: QuantPlan, recipe: Recipe) -> bool:
    """Whether a run looks at data. Round-to-nearest weights (with dynamic or no activation
    quantization) and no KV-cache scales are computed from the weights alone, as
    llm-compressor's data-free QuantizationModifier does; GPTQ (Hessians), AWQ and
    SmoothQuant (activation statistics), static activation scales and KV-cache scales
    need calibration tokens (each method says whether it does: ``QuantMethod.needs_data``)."""
    if methods_for(recipe).needs_data or plan.kv_cache_scheme is not None:
        return True
    return any(m.act is not None and not m.act.dynamic for m in plan.quantized)


@dataclass
class LinearReport:
    name: str
    layer: int | None
    scheme: str
    method: str
    # ||y_q - y|| / ||y|| on calibration inputs (activation quant included); a data-free
    # run has no inputs and reports the weights' ||W_q - W|| / ||W|| instead
    rel_error: float
    seconds: float
    bytes_before: int
    bytes_after: int
    gptq_loss: float | None = None
    dampening: float | None = None
    smoothing: str | None = None  # e.g. "awq alpha=0.35"

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class RunResult:
    linears: list[LinearReport] = field(default_factory=list)
    layer_seconds: list[float] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    experts: list[dict] = field(default_factory=list)  # moe_report rows, per layer and expert
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)


class LayerQuantizer:
    """Runs one checkpoint through the plan; see the module docstring."""

    def __init__(self, ckpt: Checkpoint, plan: QuantPlan, recipe: Recipe,
                 calib: CalibrationSet | None, options: PipelineOptions, *,
                 warn: Callable[[str], None] | None = None) -> None:
        self.ckpt, self.plan, self.recipe, self.calib = ckpt, plan, recipe, calib
        self.opts = options
        self.device = torch.device(options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.cdt = options.compute_dtype
        self.config = ckpt.text_config
        self.arch = ModelArch.from_config(self.config)
        self.shape = block.BlockShape.from_arch(self.arch)
        self.methods = methods_for(recipe)
        self.result = RunResult()
        self._warn = warn or (lambda message: None)
        self.stream: LayerStream | None = None
        modifier = recipe.weight_modifier
        self.all_experts = (modifier.calibrate_all_experts if options.calibrate_all_experts
                            is None else options.calibrate_all_experts)
        self.min_expert_tokens = modifier.min_expert_tokens
        self._routed: dict[str, int] = {}  # this layer's tokens per expert (moe_report)
        self._stat_tokens: dict[str, int] = {}
        if calib is None:  # data-free (needs_calibration): weights only, no forwards
            if needs_calibration(plan, recipe):
                raise ValueError("this plan needs calibration data")
            return
        seq_len = calib.ids.shape[1]
        self.stream = LayerStream.for_model(self.arch, seq_len,
                                            max(1, options.chunk_tokens // seq_len), self.cdt,
                                            self.device)
        self.stream.all_experts = self.all_experts

    def warn(self, message: str) -> None:
        self.result.warnings.append(message)
        self._warn(message)

    # --- driving ---------------------------------------------------------------------

    def run(self, out_dir: Path, progress: Callable[[int, int], None] | None = None) -> RunResult:
        # No autograd anywhere below: inference mode skips its bookkeeping on every op
        # (measured ~10% off GPTQ's column loop, whose cost is the number of torch calls).
        with torch.inference_mode():
            return self._run(out_dir, progress)

    def _run(self, out_dir: Path, progress: Callable[[int, int], None] | None) -> RunResult:
        start = time.perf_counter()
        specs, transform = output_specs(self.ckpt, self.plan), None
        if self.ckpt.views and vllm_gpt_oss.streamed(self.plan.modules):
            # gpt-oss's WNA16 experts in the only form vLLM's gpt-oss loader reads
            specs, transform = vllm_gpt_oss.stream_specs(specs), vllm_gpt_oss.Interleaver()
        writer = PlannedWriter(out_dir, specs, self.opts.max_shard_bytes, transform)
        n_layers = self.config["num_hidden_layers"]
        lm_head = self.plan.module("lm_head")
        total = n_layers + (1 if lm_head is not None and lm_head.quantized else 0)
        try:
            X = None if self.calib is None else self._embed(writer)
            if X is None:
                writer.add("model.embed_tokens.weight", self.ckpt.get("model.embed_tokens.weight"))
            for i in range(n_layers):
                t0 = time.perf_counter()
                self._layer(i, X, writer)
                self.ckpt.close()
                self.result.layer_seconds.append(time.perf_counter() - t0)
                if progress:
                    progress(i + 1, total)
            self._head(X, writer)
            if progress:
                progress(total, total)
            self.result.files = writer.finish()
        finally:
            writer.close()
            self.ckpt.close()
        self.result.seconds = time.perf_counter() - start
        return self.result

    def _embed(self, writer: PlannedWriter) -> torch.Tensor:
        name = "model.embed_tokens.weight"
        table = self.ckpt.get(name)
        writer.add(name, table)
        table = table.to(device=self.device, dtype=self.cdt)
        return block.embed(table, self.calib.ids.to(self.device), self.arch)

    def _load_layer(self, i: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(float32 working tensors keyed without the layer prefix, untouched extras)."""
        prefix = f"model.layers.{i}."
        work, extra = {}, {}
        shape = self.shape.at(i)
        norms = (*shape.norms.values(), *block.QK_NORMS)
        for name in self.ckpt.names():
            if not name.startswith(prefix):
                continue
            key = name[len(prefix):]
            tensor = self.ckpt.get(name, torch.float32, self.device)
            module = key.removesuffix(".weight").removesuffix(".bias")
            if key.endswith("norm.weight") and key.removesuffix(".weight") in norms:
                work[key.removesuffix(".weight")] = tensor
            elif module in shape.linear_names:
                work[key] = tensor
            else:
                # the router is read by the forward and written back as it was (bit for bit)
                if module in shape.full_precision:
                    work[key] = tensor
                extra[name] = self.ckpt.get(name)
        return work, extra

    # --- one layer -----------------------------------------------------------------------

    def _layer(self, i: int, X: torch.Tensor, writer: PlannedWriter) -> None:
        work, extra = self._load_layer(i)
        prefix = f"model.layers.{i}."
        shape = self.shape.at(i)
        plans = {k: self.plan.module(prefix + k) for k in shape.linear_names}
        self._routed, self._stat_tokens = {}, {}
        if self.stream is not None:
            self.stream.at(i)
        smoothed = Smoothed()
        if self.methods.smoother is not None:
            smoothed = smooth_layer(i, X, work, plans, self.methods.smoother, self.stream,
                                    self.warn)
            smooth_experts(i, X, work, plans, self.methods.smoother, self.stream, self.warn,
                           smoothed)
        self._kv_amax = torch.zeros(2, self.shape.kv_heads)
        quantized = (self._quantize_layer_data_free(i, work, plans) if X is None
                     else self._quantize_layer(i, X, work, plans, smoothed))
        if self.plan.kv_cache_scheme is not None:
            amax = self._kv_amax if self.plan.kv_per_head else self._kv_amax.amax(1, keepdim=True)
            scales = kv_cache_scales(amax)
            writer.add(f"{prefix}self_attn.k_scale", scales[0].clone())
            writer.add(f"{prefix}self_attn.v_scale", scales[1].clone())
        for k, plan in plans.items():
            name = prefix + k
            bias = work.get(f"{k}.bias")
            dtype = self.ckpt.dtype(f"{name}.weight")
            if plan is not None and plan.quantized:
                writer.add_all(module_tensors(plan, quantized[k], dtype))
            else:
                writer.add(f"{name}.weight", work[f"{k}.weight"].to(dtype))
            if bias is not None:
                writer.add(f"{name}.bias", bias.to(self.ckpt.dtype(f"{name}.bias")))
        for norm in (*self.shape.norms.values(), *block.QK_NORMS):
            if norm in work:
                writer.add(f"{prefix}{norm}.weight",
                           work[norm].to(self.ckpt.dtype(f"{prefix}{norm}.weight")))
        writer.add_all(extra)
        if shape.moe is not None:
            self.result.experts.extend(self._expert_rows(i, shape))

    def _expert_rows(self, i: int, shape: block.BlockShape) -> list[dict]:
        """Per expert of layer ``i``: calibration tokens routed to it, tokens its
        statistics saw, whether it fell back to round-to-nearest, each linear's error."""
        errors = {r.name: r.rel_error for r in self.result.linears if r.layer == i}
        rows = []
        for group, kinds in shape.groups("mlp_in"):
            names = [f"model.layers.{i}.{k}" for k in (*kinds, *dict(shape.groups("mlp_act"))[group])]
            routed = self._routed.get(group)
            rows.append({"layer": i, "expert": group.removeprefix("expert."),
                         "module": names[0].rsplit(".", 1)[0],
                         "routed_tokens": routed, "stat_tokens": self._stat_tokens.get(group),
                         "under_calibrated": routed is not None and not self.all_experts
                         and group != "shared" and routed < self.min_expert_tokens,
                         "rel_error": {n: errors[n] for n in names if n in errors}})
        return rows

    def _observe_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Running absmax per KV head of the keys and values, ``(batch, kv_heads, seq, d)``."""
        for j, x in enumerate((k, v)):
            seen = x.abs().amax(dim=(0, 2, 3)).float().cpu()
            self._kv_amax[j] = torch.maximum(self._kv_amax[j], seen)

    # --- quantization pass -----------------------------------------------------------------

    def _needs(self, plans: list[ModulePlan | None], has_moment: bool) -> Needs:
        """What the weight method needs at a tap: nothing where no linear is quantized."""
        if not any(p is not None and p.quantized for p in plans):
            return NOTHING
        return self.methods.weights.weight_needs(has_moment)

    def _quantize_layer(self, i: int, X: torch.Tensor, work: dict, plans: dict,
                        smoothed: Smoothed) -> dict[str, QuantizedLinear]:
        stream = self.stream
        fw = stream.forward_weights(work)
        acts: dict[str, Callable] = {}
        linear = stream.linear(fw, acts)
        # K/V scales from the quantization pass: q/k/v are already quantized at
        # attn_out, as llm-compressor observes the KV cache of the model it builds
        observe = self._observe_kv if self.plan.kv_cache_scheme else None
        quantized: dict[str, QuantizedLinear] = {}
        for tap in block.TAPS:
            if stream.shape.moe is not None and tap in ("mlp_in", "mlp_act"):
                quantized.update(self._quantize_experts(i, tap, X, work, plans, fw, linear,
                                                        acts, smoothed.notes))
                continue
            kinds = list(stream.shape.linears[tap])
            needs = self._needs([plans[k] for k in kinds], tap in smoothed.moments)
            stats = TapStats(stream.tap_dim(tap), needs, self.device)
            stats.preset_moment = smoothed.moments.get(tap)
            stream.inputs(tap, X, fw, linear, stats, advance=True, observe_kv=observe)
            quantized.update(self._quantize_tap(i, kinds, work, plans, stats, fw, acts,
                                                smoothed.notes))
            del stats
        stream.inputs("out", X, fw, linear, None, advance=True)
        return quantized

    def _quantize_experts(self, i: int, tap: str, X: torch.Tensor, work: dict, plans: dict,
                          fw: dict, linear: Callable, acts: dict,
                          notes: dict[str, str]) -> dict[str, QuantizedLinear]:
        """A mixture of experts' tap: statistics per expert (``moe_block``), then each
        expert's linears against its own. With calibrate_all_experts off, an expert the
        router sent fewer than min_expert_tokens tokens is quantized round-to-nearest
        (its statistics would be empty or a handful of tokens: NaN or meaningless scales)."""
        shape = self.stream.shape
        groups = shape.groups(tap)
        needs = self._needs([plans[k] for _, kinds in groups for k in kinds], False)
        stats = ExpertStats({g: shape.tap_dim(tap, g) for g, _ in groups}, needs, self.device,
                            shared_input=tap == "mlp_in" and self.all_experts)
        self.stream.inputs(tap, X, fw, linear, stats, advance=True)
        if tap == "mlp_in":
            self._routed = dict(stats.counts)
            self._stat_tokens = {g: s.count for g, s in stats.groups.items()}
        short = [g for g, _ in groups if not self.all_experts and g != "shared"
                 and self._routed[g] < self.min_expert_tokens]
        if short and tap == "mlp_in":
            self.warn(f"layer {i}: {len(short)} expert(s) received fewer than "
                      f"{self.min_expert_tokens} calibration token(s) and are quantized "
                      "round-to-nearest (calibrate_all_experts is off): "
                      + ", ".join(f"{self.expert_module(i, shape, g)} ({self._routed[g]})"
                                  for g in short))
        out: dict[str, QuantizedLinear] = {}
        for group, kinds in groups:
            g_stats = stats.groups[group]
            if g_stats.count == 0:  # a static activation scale from the whole tap's range
                g_stats.lo, g_stats.hi = stats.tap_range()
            out.update(self._quantize_tap(i, list(kinds), work, plans, g_stats, fw, acts, notes,
                                          fallback=group in short))
        return out

    @staticmethod
    def expert_module(i: int, shape: block.BlockShape, group: str) -> str:
        """The module name of an expert group, e.g. ``model.layers.0.mlp.experts.3``."""
        kinds = dict(shape.groups("mlp_in"))[group]
        return f"model.layers.{i}.{kinds[0].rsplit('.', 1)[0]}"

    def _quantize_layer_data_free(self, i: int, work: dict,
                                  plans: dict) -> dict[str, QuantizedLinear]:
        """Round-to-nearest from the weights alone (no calibration forwards)."""
        quantized: dict[str, QuantizedLinear] = {}
        shape = self.shape.at(i)
        for tap in block.TAPS:
            for _, kinds in shape.groups(tap):  # each expert apart (a scale per tensor too)
                quantized.update(self._quantize_tap(i, list(kinds), work, plans, None, {}, {},
                                                    {}))
        return quantized

    def _quantize_tap(self, i: int, kinds: list[str], work: dict, plans: dict,
                      stats: TapStats | None,
                      fw: dict, acts: dict, smoothing: dict[str, str], *,
                      fallback: bool = False) -> dict[str, QuantizedLinear]:
        """Quantize the linears fed by one tap; linears with the same scheme are fused
        (q/k/v, gate/up share their input and so their Hessian). ``fallback``:
        round-to-nearest whatever the method (statistics too thin to use)."""
        out: dict[str, QuantizedLinear] = {}
        todo = [k for k in kinds if plans[k] is not None and plans[k].quantized]
        while todo:
            spec, act = plans[todo[0]].weight, plans[todo[0]].act
            fused = [k for k in todo if plans[k].weight == spec and plans[k].act == act]
            todo = [k for k in todo if k not in fused]
            t0 = time.perf_counter()
            W = torch.cat([work[f"{k}.weight"] for k in fused], dim=0)
            rows = [work[f"{k}.weight"].shape[0] for k in fused]
            res = self._quantize_weight(i, fused, rows, W, spec, stats, fallback)
            seconds = time.perf_counter() - t0
            act_fn, in_scale, in_zero = (None, None, None) if stats is None \
                else act_quantizer(act, stats)
            start = 0
            for k, n in zip(fused, rows):
                sl = slice(start, start + n)
                start += n
                per_tensor = spec.strategy == "tensor"
                q = QuantizedLinear(res.codes[sl], res.scale if per_tensor else res.scale[sl],
                                    None if res.zero is None else (res.zero if per_tensor
                                                                   else res.zero[sl]),
                                    in_scale, in_zero)
                deq = dequantize(q.codes, q.scale, q.zero, spec)
                fw[f"{k}.weight"] = deq.to(self.cdt)
                if act_fn is not None:
                    acts[k] = act_fn
                out[k] = q
                self.result.linears.append(LinearReport(
                    name=plans[k].name, layer=i, scheme=plans[k].weight.label()
                    + (f" / {act.label()}" if act else ""),
                    method="rtn" if fallback else self.plan.method, rel_error=self._rel_error(stats, work[f"{k}.weight"],
                                                                         deq, act_fn),
                    seconds=seconds * n / sum(rows), bytes_before=plans[k].bytes_before,
                    bytes_after=plans[k].bytes_after,
                    gptq_loss=None if res.loss is None else res.loss * n / sum(rows),
                    dampening=res.dampening, smoothing=smoothing.get(k)))
        return out

    def _quantize_weight(self, i: int, kinds: list[str], rows: list[int], W: torch.Tensor,
                         spec: WeightSpec, stats: TapStats | None,
                         fallback: bool = False) -> WeightResult:
        """The weight method's codes and scales for the stacked weights ``W``."""
        job = WeightJob(layer=i, kinds=kinds, rows=rows, W=W, spec=spec, grid=weight_grid(spec),
                        stats=stats, warn=self.warn)
        method = self.methods.fallback if fallback else self.methods.weights
        return method.quantize(job)

    def _rel_error(self, stats: TapStats | None, W: torch.Tensor, deq: torch.Tensor,
                   act_fn: Callable | None) -> float:
        if stats is None or not stats.probe:  # data-free (or no tokens): the weights' own
            return float((deq.float() - W.float()).norm() / W.float().norm().clamp(min=1e-12))
        x = torch.cat(stats.probe).float()
        ref = x @ W.float().t()
        xq = act_fn(x) if act_fn is not None else x
        got = xq @ deq.float().t()
        return float((got - ref).norm() / ref.norm().clamp(min=1e-12))

    # --- final norm and lm_head --------------------------------------------------------------

    def _head(self, X: torch.Tensor, writer: PlannedWriter) -> None:
        norm = self.ckpt.get("model.norm.weight")
        writer.add("model.norm.weight", norm)
        lm = self.plan.module("lm_head")
        if lm is None:
            return
        if not lm.quantized:
            writer.add("lm_head.weight", self.ckpt.get("lm_head.weight"))
            return
        W = self.ckpt.get("lm_head.weight", torch.float32, self.device)
        if X is None:  # data-free
            out = self._quantize_tap(-1, ["lm_head"], {"lm_head.weight": W}, {"lm_head": lm},
                                     None, {}, {}, {})
            self.result.linears[-1].layer = None
            writer.add_all(module_tensors(lm, out["lm_head"], self.ckpt.dtype("lm_head.weight")))
            return
        # no smoothing pass reaches lm_head: a method that reuses its moment collects it
        stats = TapStats(self.shape.hidden, self._needs([lm], has_moment=False), self.device)
        nw = norm.to(self.device, self.cdt)
        for c in self.stream.chunks(X.shape[0]):
            stats.add(self.shape.norm(X[c], nw))
        t0 = time.perf_counter()
        res = self._quantize_weight(-1, ["lm_head"], [W.shape[0]], W, lm.weight, stats)
        act_fn, in_scale, in_zero = act_quantizer(lm.act, stats)
        q = QuantizedLinear(res.codes, res.scale, res.zero, in_scale, in_zero)
        writer.add_all(module_tensors(lm, q, self.ckpt.dtype("lm_head.weight")))
        self.result.linears.append(LinearReport(
            name="lm_head", layer=None, scheme=lm.weight.label(), method=self.plan.method,
            rel_error=self._rel_error(stats, W, dequantize(q.codes, q.scale, q.zero, lm.weight),
                                      act_fn),
            seconds=time.perf_counter() - t0, bytes_before=lm.bytes_before,
            bytes_after=lm.bytes_after, gptq_loss=res.loss, dampening=res.dampening))

def output_specs(ckpt: Checkpoint, plan: QuantPlan) -> dict[str, TensorSpec]:
    """Every tensor the output will hold: quantized linears in their format, the rest as
    in the input (same dtype, so smoothed norms keep their precision)."""
    quantized = {f"{m.name}.weight": m for m in plan.quantized}
    specs: dict[str, TensorSpec] = {}
    for name in ckpt.names():
        if name in quantized:
            specs.update(module_tensor_specs(quantized[name], ckpt.dtype(name)))
        else:
            specs[name] = TensorSpec(ckpt.dtype(name), ckpt.shape(name))
    if plan.kv_cache_scheme is not None:  # one scale per layer, or one per KV head
        shape = (kv_heads(ckpt),) if plan.kv_per_head else (1,)
        config = ckpt.text_config or ckpt.config
        for i in range(int(config["num_hidden_layers"])):
            for kv in "kv":
                specs[f"model.layers.{i}.self_attn.{kv}_scale"] = TensorSpec(torch.float32,
                                                                            shape)
    return specs
