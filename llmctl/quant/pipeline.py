"""Layer-by-layer quantization: one decoder layer in memory at a time.

For each layer the calibration activations (the residual stream ``X`` of every
calibration token, as produced by the *already quantized* layers before it) flow
through the layer stage by stage, and each linear is quantized as soon as its input is
known:

    attn_in  = norm1(X)          -> q, k, v quantized (one fused GPTQ for the three)
    attn_out = attention(...)    -> o quantized           (q, k, v already quantized)
    X += o(attn_out); mlp_in = norm2(X) -> gate, up quantized
    mlp_act = silu(gate) * up    -> down quantized
    X += down(mlp_act)           -> the next layer's input

so each Hessian sees the inputs the quantized model really produces ("true sequential"
in the GPTQ paper), every matmul of the forward runs once, and the layer's output is
propagated with quantized weights and emulated activation quantization. Smoothing
methods (AWQ, SmoothQuant) first run the layer once in float to collect activation
statistics and fold their scales into the weights.

Peak memory is one layer plus the calibration activations (see ``memory``): weights
are read from memory-mapped safetensors per layer and written out before the next.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from llmctl.errors import ConfigError
from llmctl.quant import awq, block, fp8, rtn, smoothquant
from llmctl.quant.calibration import CalibrationSet
from llmctl.quant.checkpoint import Checkpoint
from llmctl.quant.fp8 import FP8Grid, kv_cache_scales
from llmctl.quant.gptq import gptq_quantize
from llmctl.quant.hessian import HessianAccumulator
from llmctl.quant.plan import ModulePlan, QuantPlan, WeightSpec, kv_heads, name_matches
from llmctl.quant.recipe import AWQModifier, GPTQModifier, Recipe
from llmctl.quant.writer import (
    PlannedWriter,
    QuantizedLinear,
    TensorSpec,
    module_tensor_specs,
    module_tensors,
)

PROBE_TOKENS = 512
TAP_KINDS = {tap: [k for k, t in block.LINEAR_TAP.items() if t == tap] for tap in block.TAPS}


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


def needs_calibration(plan: QuantPlan, recipe: Recipe) -> bool:
    """Whether a run looks at data. Round-to-nearest weights (with dynamic or no activation
    quantization) and no KV-cache scales are computed from the weights alone, as
    llm-compressor's data-free QuantizationModifier does; GPTQ (Hessians), AWQ and
    SmoothQuant (activation statistics), static activation scales and KV-cache scales
    need calibration tokens."""
    if plan.method != "rtn" or recipe.smoothquant is not None or plan.kv_cache_scheme is not None:
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
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)


class _TapStats:
    """What the quantizers of one tap need from its inputs, accumulated over chunks."""

    def __init__(self, dim: int, *, hessian: bool, absmax: bool, absmean: bool, device) -> None:
        self.h = HessianAccumulator(dim, device) if hessian else None
        self.absmax = torch.zeros(dim, device=device) if absmax else None
        self.abssum = torch.zeros(dim, device=device) if absmean else None
        self.lo = torch.tensor(0.0, device=device)
        self.hi = torch.tensor(0.0, device=device)
        self.count = 0
        self.probe: list[torch.Tensor] = []
        self.probe_rows = 0
        self.preset_moment: torch.Tensor | None = None  # supplied by an earlier pass

    def add(self, x: torch.Tensor) -> None:
        flat = x.reshape(-1, x.shape[-1])
        if self.h is not None:
            self.h.add(flat)
        if self.absmax is not None:
            torch.maximum(self.absmax, flat.abs().amax(dim=0).float(), out=self.absmax)
        if self.abssum is not None:
            self.abssum += flat.abs().float().sum(dim=0)
        self.lo = torch.minimum(self.lo, flat.min().float())
        self.hi = torch.maximum(self.hi, flat.max().float())
        self.count += flat.shape[0]
        if self.probe_rows < PROBE_TOKENS:
            take = flat[: PROBE_TOKENS - self.probe_rows]
            self.probe.append(take.clone())
            self.probe_rows += take.shape[0]

    @property
    def hessian(self) -> torch.Tensor:
        return self.h.hessian()

    @property
    def second_moment(self) -> torch.Tensor:
        """``X^T X / n``: the Hessian without GPTQ's factor 2."""
        if self.preset_moment is not None:
            return self.preset_moment
        return self.h.hessian() / 2

    @property
    def absmean(self) -> torch.Tensor:
        return self.abssum / max(self.count, 1)


def _act_quantizer(act, stats: _TapStats | None):
    """(callable applying the inference-time activation quantization, scale, zero)."""
    if act is None:
        return None, None, None
    if act.dynamic:
        if act.type == "float":
            fn = fp8.fake_quantize_per_token if act.strategy == "token" else (
                lambda x: fp8.fake_quantize(x, fp8.scale_for(x.abs().amax())))
        elif act.strategy == "token":
            fn = lambda x: rtn.fake_quantize_per_token(x, act.bits, act.symmetric)
        else:
            grid = rtn.IntGrid(act.bits, act.symmetric, None)
            fn = lambda x: rtn.fake_quantize(x.float(), grid).to(x.dtype)
        return fn, None, None
    if act.type == "float":
        scale = fp8.scale_for(torch.maximum(-stats.lo, stats.hi)).reshape(1)
        return (lambda x: fp8.fake_quantize_static(x, scale)), scale, None
    scale, zero = rtn.params_from_range(stats.lo, stats.hi, rtn.IntGrid(act.bits, act.symmetric))
    scale, zero = scale.reshape(1), None if zero is None else zero.reshape(1)
    return (lambda x: rtn.fake_quantize_static(x, scale, zero, act.bits)), scale, zero


class LayerQuantizer:
    """Runs one checkpoint through the plan; see the module docstring."""

    def __init__(self, ckpt: Checkpoint, plan: QuantPlan, recipe: Recipe,
                 calib: CalibrationSet | None, options: PipelineOptions, *,
                 warn: Callable[[str], None] | None = None) -> None:
        from transformers import AutoConfig

        self.ckpt, self.plan, self.recipe, self.calib = ckpt, plan, recipe, calib
        self.opts = options
        self.device = torch.device(options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.cdt = options.compute_dtype
        self.config = ckpt.text_config
        self.shape = block.BlockShape.from_config(self.config)
        self.hf_config = AutoConfig.from_pretrained(str(ckpt.path))
        self.modifier = recipe.weight_modifier
        self.result = RunResult()
        self._warn = warn or (lambda message: None)
        if calib is None:  # data-free (needs_calibration): weights only, no forwards
            if needs_calibration(plan, recipe):
                raise ValueError("this plan needs calibration data")
            return
        seq_len = calib.ids.shape[1]
        self.chunk = max(1, options.chunk_tokens // seq_len)
        self.cos, self.sin = block.rotary_tables(self.hf_config, seq_len, self.cdt, self.device)

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
        writer = PlannedWriter(out_dir, output_specs(self.ckpt, self.plan), self.opts.max_shard_bytes)
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
        return table[self.calib.ids.to(self.device)]

    def _chunks(self, n: int):
        for start in range(0, n, self.chunk):
            yield slice(start, min(start + self.chunk, n))

    def _load_layer(self, i: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(float32 working tensors keyed without the layer prefix, untouched extras)."""
        prefix = f"model.layers.{i}."
        work, extra = {}, {}
        for name in self.ckpt.names():
            if not name.startswith(prefix):
                continue
            key = name[len(prefix):]
            tensor = self.ckpt.get(name, torch.float32, self.device)
            if key.endswith("norm.weight") and key.removesuffix(".weight") in (*block.NORMS, *block.QK_NORMS):
                work[key.removesuffix(".weight")] = tensor
            elif key.removesuffix(".weight").removesuffix(".bias") in block.LINEAR_TAP:
                work[key] = tensor
            else:
                extra[name] = self.ckpt.get(name)
        return work, extra

    # --- one layer -----------------------------------------------------------------------

    def _layer(self, i: int, X: torch.Tensor, writer: PlannedWriter) -> None:
        work, extra = self._load_layer(i)
        prefix = f"model.layers.{i}."
        plans = {k: self.plan.module(prefix + k) for k in block.LINEAR_TAP}
        smoothing: dict[str, str] = {}
        self._moments = {}
        if isinstance(self.modifier, AWQModifier) or self.recipe.smoothquant is not None:
            smoothing = self._smooth(i, X, work, plans)
        self._kv_amax = torch.zeros(2, self.shape.kv_heads)
        quantized = (self._quantize_layer_data_free(i, work, plans) if X is None
                     else self._quantize_layer(i, X, work, plans, smoothing))
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
        for norm in (*block.NORMS, *block.QK_NORMS):
            if norm in work:
                writer.add(f"{prefix}{norm}.weight",
                           work[norm].to(self.ckpt.dtype(f"{prefix}{norm}.weight")))
        writer.add_all(extra)

    def _observe_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Running absmax per KV head of the keys and values, ``(batch, kv_heads, seq, d)``."""
        for j, x in enumerate((k, v)):
            seen = x.abs().amax(dim=(0, 2, 3)).float().cpu()
            self._kv_amax[j] = torch.maximum(self._kv_amax[j], seen)

    def _forward_weights(self, work: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.cdt) for k, v in work.items()}

    def _linear(self, weights: dict[str, torch.Tensor], acts: dict[str, Callable]):
        def apply(name: str, x: torch.Tensor) -> torch.Tensor:
            fn = acts.get(name)
            if fn is not None:
                x = fn(x)
            return F.linear(x, weights[f"{name}.weight"], weights.get(f"{name}.bias"))

        return apply

    def _buffers(self, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output (o_proj's input) and the MLP activation (down_proj's input)
        for every calibration token. They are never alive at the same time in the
        quantization pass, so they share one buffer sized for the larger."""
        if not hasattr(self, "_buffer"):
            n, t, _ = X.shape
            self._dims = (self.shape.heads * self.shape.head_dim, self.config["intermediate_size"])
            self._buffer = torch.empty(n * t * max(self._dims), dtype=self.cdt, device=self.device)
        n, t, _ = X.shape
        attn = self._buffer[: n * t * self._dims[0]].view(n, t, self._dims[0])
        act = self._buffer[: n * t * self._dims[1]].view(n, t, self._dims[1])
        return attn, act

    def _tap_inputs(self, tap: str, X: torch.Tensor, fw: dict, linear, stats: _TapStats | None,
                    advance: bool) -> None:
        """Run every chunk up to ``tap``'s input, feeding ``stats``.

        With ``advance`` the residual stream is updated in place on the way (the
        quantization pass: o_proj's output is added before mlp_in, down_proj's after
        mlp_act); without it X stays the layer input (the float smoothing pass).
        """
        A, Act = self._buffers(X)
        for c in self._chunks(X.shape[0]):
            if tap == "attn_in":
                h = block.attn_input(X[c], fw, self.shape)
            elif tap == "attn_out":
                # K/V scales from the quantization pass: q/k/v are already quantized
                # here, as llm-compressor observes the KV cache of the model it builds
                observe = self._observe_kv if advance and self.plan.kv_cache_scheme else None
                h = block.attention(block.attn_input(X[c], fw, self.shape), fw, linear,
                                    self.shape, self.cos, self.sin, observe)
                A[c] = h
            elif tap == "mlp_in":
                x2 = X[c] + linear("self_attn.o_proj", A[c])
                if advance:
                    X[c] = x2
                h = block.mlp_input(x2, fw, self.shape)
            elif tap == "mlp_act":
                x2 = X[c] if advance else X[c] + linear("self_attn.o_proj", A[c])
                h = block.mlp_act(block.mlp_input(x2, fw, self.shape), linear)
                if advance:  # (the smoothing pass still reads A here and needs no Act)
                    Act[c] = h
            else:  # "out": the layer output
                X[c] += linear("mlp.down_proj", Act[c])
                continue
            if stats is not None:
                stats.add(h)

    # --- smoothing (AWQ / SmoothQuant) ---------------------------------------------------------

    def _smoothing_targets(self, i: int, plans: dict[str, ModulePlan | None]) -> dict[str, list[str]]:
        """tap -> balanced linear kinds, from the recipe's mappings for layer ``i``."""
        prefix = f"model.layers.{i}."
        sq = self.recipe.smoothquant
        if sq is not None:
            mappings = [(smooth, balance) for balance, smooth in sq.resolved_mappings()]
        else:
            mappings = [(m.smooth_layer, m.balance_layers) for m in self.modifier.resolved_mappings()]
        found: dict[str, list[str]] = {}
        for smooth, balance in mappings:
            taps = [t for t, src in block.TAP_SOURCE.items() if name_matches(prefix + src, smooth)]
            if not taps:
                continue
            tap = taps[0]
            consumers = TAP_KINDS[tap]
            kinds = [k for k in consumers if any(name_matches(prefix + k, b) for b in balance)]
            if not kinds:
                continue
            if sorted(kinds) != sorted(consumers):
                raise ConfigError(
                    f"smoothing {block.TAP_SOURCE[tap]} rescales only {', '.join(kinds)}",
                    f"the mapping's balance layers must cover every consumer: {', '.join(consumers)}")
            if tap == "attn_out" and self.shape.kv_heads != self.shape.heads:
                continue  # v_proj -> o_proj needs matching shapes (not under GQA)
            if any(plans[k] is None or not plans[k].quantized for k in kinds):
                continue  # nothing quantized to protect
            if sq is not None and any(name_matches(prefix + k, ig) for k in kinds for ig in sq.ignore):
                continue
            found[tap] = kinds
        return found

    def _smooth(self, i: int, X: torch.Tensor, work: dict, plans: dict) -> dict[str, str]:
        """Float pass over the layer: choose and fold smoothing scales tap by tap.

        For AWQ it also keeps every tap's input second moment (rescaled when scales are
        folded in), which the clipping search reuses instead of collecting it again."""
        targets = self._smoothing_targets(i, plans)
        notes: dict[str, str] = {}
        is_awq = isinstance(self.modifier, AWQModifier)
        self._moments: dict[str, torch.Tensor] = {}
        wanted = [t for t in block.TAPS if t in targets or (is_awq and any(
            plans[k] is not None and plans[k].quantized for k in TAP_KINDS[t]))]
        if not targets and not is_awq:
            return notes
        for tap in block.TAPS[: max((block.TAPS.index(t) for t in wanted), default=-1) + 1]:
            fw = self._forward_weights(work)
            linear = self._linear(fw, {})
            stats = None
            if tap in wanted:
                stats = _TapStats(self._tap_dim(tap), hessian=is_awq, absmax=not is_awq,
                                  absmean=is_awq and tap in targets, device=self.device)
            self._tap_inputs(tap, X, fw, linear, stats, advance=False)
            if stats is None:
                continue
            moment = stats.second_moment if is_awq else None
            if tap not in targets:
                self._moments[tap] = moment
                continue
            kinds = targets[tap]
            weights = [work[f"{k}.weight"] for k in kinds]
            if is_awq:
                spec = plans[kinds[0]].weight
                if any(plans[k].weight != spec for k in kinds) or spec.type != "int":
                    self.warn(f"layer {i}: AWQ skipped {block.TAP_SOURCE[tap]} (its linears "
                              "differ in scheme or are not integer)")
                    self._moments[tap] = moment
                    continue
                found = awq.search_scales(weights, moment, stats.absmean, spec.grid,
                                          n_grid=self.modifier.n_grid,
                                          duo_scaling=self.modifier.duo_scaling,
                                          matmul_dtype=self.cdt,
                                          loss_fn=self._block_loss(tap, kinds, X, fw))
                scales = found.scales
                self._moments[tap] = awq.scale_hessian(moment, scales)
                note = f"awq alpha={found.alpha:.2f}"
            else:
                scales = smoothquant.smoothing_scales(stats.absmax, weights,
                                                      self.recipe.smoothquant.smoothing_strength)
                note = f"smoothquant alpha={self.recipe.smoothquant.smoothing_strength:g}"
            self._fold(work, tap, kinds, scales)
            for k in kinds:
                notes[k] = note
        return notes

    def _block_loss(self, tap: str, kinds: list[str], X: torch.Tensor, fw: dict):
        """AWQ's block objective for the q/k/v and gate/up mappings: the error of the
        attention block's (MLP's) output on a subset of calibration sequences, with the
        rest of the block in float. None means: the linears' own output error."""
        if self.modifier.objective != "block" or tap not in ("attn_in", "mlp_in"):
            return None
        n = max(1, min(X.shape[0], self.modifier.objective_tokens // X.shape[1]))
        A, _ = self._buffers(X)
        float_linear = self._linear(fw, {})
        if tap == "attn_in":
            h = block.attn_input(X[:n], fw, self.shape)

            def run(linear) -> torch.Tensor:
                a = block.attention(h, fw, linear, self.shape, self.cos, self.sin)
                return float_linear("self_attn.o_proj", a)
        else:
            h = block.mlp_input(X[:n] + float_linear("self_attn.o_proj", A[:n]), fw, self.shape)

            def run(linear) -> torch.Tensor:
                return float_linear("mlp.down_proj", block.mlp_act(h, linear))

        reference = run(float_linear).float()

        def loss(effective: list[torch.Tensor]) -> float:
            weights = dict(fw)
            for k, w in zip(kinds, effective):
                weights[f"{k}.weight"] = w.to(self.cdt)
            return float((run(self._linear(weights, {})).float() - reference).pow(2).mean())

        return loss

    @staticmethod
    def _fold(work: dict, tap: str, kinds: list[str], scales: torch.Tensor) -> None:
        """x -> x / s at the source, W -> W diag(s) in the consumers: the float model's
        output does not change."""
        source = block.TAP_SOURCE[tap]
        if source in work:  # a norm's weight
            work[source] = work[source] / scales
        else:  # a linear's output rows (and bias)
            work[f"{source}.weight"] = work[f"{source}.weight"] / scales.unsqueeze(1)
            if f"{source}.bias" in work:
                work[f"{source}.bias"] = work[f"{source}.bias"] / scales
        for k in kinds:
            work[f"{k}.weight"] = work[f"{k}.weight"] * scales.unsqueeze(0)

    def _tap_dim(self, tap: str) -> int:
        return {"attn_in": self.shape.hidden, "mlp_in": self.shape.hidden,
                "attn_out": self.shape.heads * self.shape.head_dim,
                "mlp_act": self.config["intermediate_size"]}[tap]

    # --- quantization pass -----------------------------------------------------------------

    def _needs(self, plans: list[ModulePlan]) -> dict[str, bool]:
        """GPTQ needs its Hessian from the quantization pass itself (the inputs of the
        already-quantized layer); AWQ reuses the moments of its smoothing pass."""
        quantized = [p for p in plans if p is not None and p.quantized]
        return {"hessian": bool(quantized) and isinstance(self.modifier, GPTQModifier),
                "absmax": False, "absmean": False}


    def _quantize_layer(self, i: int, X: torch.Tensor, work: dict, plans: dict,
                        smoothing: dict[str, str]) -> dict[str, QuantizedLinear]:
        fw = self._forward_weights(work)
        acts: dict[str, Callable] = {}
        linear = self._linear(fw, acts)
        quantized: dict[str, QuantizedLinear] = {}
        for tap in block.TAPS:
            kinds = TAP_KINDS[tap]
            needs = self._needs([plans[k] for k in kinds])
            stats = _TapStats(self._tap_dim(tap), device=self.device, **needs)
            stats.preset_moment = getattr(self, "_moments", {}).get(tap)
            self._tap_inputs(tap, X, fw, linear, stats, advance=True)
            quantized.update(self._quantize_tap(i, kinds, work, plans, stats, fw, acts, smoothing))
            del stats
        self._tap_inputs("out", X, fw, linear, None, advance=True)
        return quantized

    def _quantize_layer_data_free(self, i: int, work: dict,
                                  plans: dict) -> dict[str, QuantizedLinear]:
        """Round-to-nearest from the weights alone (no calibration forwards)."""
        quantized: dict[str, QuantizedLinear] = {}
        for tap in block.TAPS:
            quantized.update(self._quantize_tap(i, TAP_KINDS[tap], work, plans, None, {}, {}, {}))
        return quantized

    def _quantize_tap(self, i: int, kinds: list[str], work: dict, plans: dict,
                      stats: _TapStats | None,
                      fw: dict, acts: dict, smoothing: dict[str, str]) -> dict[str, QuantizedLinear]:
        """Quantize the linears fed by one tap; linears with the same scheme are fused
        (q/k/v, gate/up share their input and so their Hessian)."""
        out: dict[str, QuantizedLinear] = {}
        todo = [k for k in kinds if plans[k] is not None and plans[k].quantized]
        while todo:
            spec, act = plans[todo[0]].weight, plans[todo[0]].act
            fused = [k for k in todo if plans[k].weight == spec and plans[k].act == act]
            todo = [k for k in todo if k not in fused]
            t0 = time.perf_counter()
            W = torch.cat([work[f"{k}.weight"] for k in fused], dim=0)
            rows = [work[f"{k}.weight"].shape[0] for k in fused]
            codes, scale, zero, loss, damp = self._quantize_weight(i, fused, rows, W, spec, stats)
            seconds = time.perf_counter() - t0
            act_fn, in_scale, in_zero = (None, None, None) if stats is None \
                else _act_quantizer(act, stats)
            start = 0
            for k, n in zip(fused, rows):
                sl = slice(start, start + n)
                start += n
                per_tensor = spec.strategy == "tensor"
                q = QuantizedLinear(codes[sl], scale if per_tensor else scale[sl],
                                    None if zero is None else (zero if per_tensor else zero[sl]),
                                    in_scale, in_zero)
                deq = self._dequantize(q, spec)
                fw[f"{k}.weight"] = deq.to(self.cdt)
                if act_fn is not None:
                    acts[k] = act_fn
                out[k] = q
                self.result.linears.append(LinearReport(
                    name=plans[k].name, layer=i, scheme=plans[k].weight.label()
                    + (f" / {act.label()}" if act else ""),
                    method=self.plan.method, rel_error=self._rel_error(stats, work[f"{k}.weight"],
                                                                         deq, act_fn),
                    seconds=seconds * n / sum(rows), bytes_before=plans[k].bytes_before,
                    bytes_after=plans[k].bytes_after,
                    gptq_loss=None if loss is None else loss * n / sum(rows), dampening=damp,
                    smoothing=smoothing.get(k)))
        return out

    def _quantize_weight(self, i: int, kinds: list[str], rows: list[int], W: torch.Tensor,
                         spec: WeightSpec, stats: _TapStats):
        """(codes, scale, zero, gptq loss, dampening) for the stacked weights ``W``."""
        grid = FP8Grid(spec.strategy == "channel") if spec.type == "float" else spec.grid
        if isinstance(self.modifier, GPTQModifier):
            res = gptq_quantize(W, stats.hessian, grid, block_size=self.modifier.block_size,
                                dampening=self.modifier.dampening_frac, actorder=spec.actorder,
                                observer=spec.observer)
            if res.fallback:
                names = ", ".join(f"model.layers.{i}.{k}" for k in kinds)
                self.warn(f"GPTQ could not invert the Hessian of {names} even with 100x "
                          f"dampening; used round-to-nearest there (raise dampening_frac in "
                          f"the recipe or add calibration samples)")
            return res.q, res.scale, res.zero, (None if res.fallback else res.loss), res.dampening
        if spec.type == "float":
            codes, scale = fp8.rtn_quantize(W, grid)
            return codes, scale, None, None, None
        scale, zero = rtn.observe(W, grid, spec.observer)
        if isinstance(self.modifier, AWQModifier) and self.modifier.apply_clip \
                and spec.strategy != "tensor":
            clip_scale, clip_zero = awq.clip_search(W, stats.second_moment, grid,
                                                    n_grid=self.modifier.n_grid,
                                                    max_shrink=self.modifier.max_shrink)
            # AutoAWQ does not clip q/k: attention logits are sensitive to their range.
            keep = torch.cat([torch.full((n,), k in ("self_attn.q_proj", "self_attn.k_proj"))
                              for k, n in zip(kinds, rows)]).to(W.device).unsqueeze(1)
            scale = torch.where(keep, scale, clip_scale)
            zero = None if zero is None else torch.where(keep, zero, clip_zero)
        return rtn.quantize(W, scale, zero, grid), scale, zero, None, None

    @staticmethod
    def _dequantize(q: QuantizedLinear, spec: WeightSpec) -> torch.Tensor:
        if spec.type == "float":
            return fp8.dequantize(q.codes, q.scale)
        return rtn.dequantize(q.codes, q.scale, q.zero, spec.grid)

    def _rel_error(self, stats: _TapStats | None, W: torch.Tensor, deq: torch.Tensor,
                   act_fn: Callable | None) -> float:
        if stats is None:  # data-free: the weights' own error
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
        needs = self._needs([lm])
        needs["hessian"] = needs["hessian"] or isinstance(self.modifier, AWQModifier)
        stats = _TapStats(self.shape.hidden, device=self.device, **needs)
        nw = norm.to(self.device, self.cdt)
        for c in self._chunks(X.shape[0]):
            stats.add(block.rms_norm(X[c], nw, self.shape.eps))
        t0 = time.perf_counter()
        codes, scale, zero, loss, damp = self._quantize_weight(-1, ["lm_head"], [W.shape[0]], W,
                                                               lm.weight, stats)
        act_fn, in_scale, in_zero = _act_quantizer(lm.act, stats)
        q = QuantizedLinear(codes, scale, zero, in_scale, in_zero)
        writer.add_all(module_tensors(lm, q, self.ckpt.dtype("lm_head.weight")))
        self.result.linears.append(LinearReport(
            name="lm_head", layer=None, scheme=lm.weight.label(), method=self.plan.method,
            rel_error=self._rel_error(stats, W, self._dequantize(q, lm.weight), act_fn),
            seconds=time.perf_counter() - t0, bytes_before=lm.bytes_before,
            bytes_after=lm.bytes_after, gptq_loss=loss, dampening=damp))



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
