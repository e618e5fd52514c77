"""``llmctl plan``: will a model fit on this hardware, and how fast can it be, from its
config alone (no weights).

1. Memory, per GPU, the way vLLM budgets it: ``gpu_memory_utilization`` (default 0.9) of
   the device's memory; the weights (sharded ``tp`` ways), an activation workspace (see
   :func:`activation_bytes`) and what is left holds the KV cache. The model fits when the
   cache holds one sequence of ``context`` tokens (vLLM refuses to start otherwise).
2. Time of one step: ``compute = FLOPs / (peak FLOP/s * compute efficiency)`` and
   ``memory = bytes / (peak bandwidth * bandwidth efficiency)``, from
   :class:`llmctl.perf.costs.ModelCost`. The roofline is their max, and the larger names
   the bound. The estimate combines them as the :class:`Efficiency` says (max where the
   hardware overlaps loads with arithmetic, the sum where it does not) and adds a fixed
   cost per layer and per step. TTFT is the prefill of one ``prompt_len`` prompt on an
   idle server (in chunks of ``max_num_batched_tokens``); TPOT is one decode step with
   ``batch`` sequences each ``context`` tokens long (the slowest step of full-length
   generations), at batch 1, 2, 4, ... up to the concurrency the KV cache allows.
3. SLOs (``p95_ttft_ms<=500``) are compared with these estimates; a roofline has no
   spread, so every percentile is compared with the same number (leave margin).
4. When the model does not fit or misses an SLO, variants are planned again (another
   weight format, an fp8 KV cache, more tensor parallelism) and listed with the numbers
   they change.

Tensor parallelism divides FLOPs, weights and KV heads (a GPU keeps at least one KV head:
vLLM replicates them when ``tp`` exceeds their count); its all-reduces (two per layer)
are not modelled, so ``tp > 1`` times are optimistic by their latency.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

from llmctl.errors import ConfigError
from llmctl.perf.arch import ArchSpec
from llmctl.perf.costs import ModelCost
from llmctl.perf.peaks import Peaks
from llmctl.perf.weight_format import NAMED, WeightFormat

KV_DTYPES: dict[str, float] = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "fp32": 4.0}

# When the peak for the weights' compute dtype is unknown: what the products run in
# instead (vLLM runs FP8 checkpoints on GPUs without FP8 units as W8A16, via Marlin).
COMPUTE_FALLBACK: dict[str, tuple[str, ...]] = {
    "fp8": ("bf16", "fp16"), "int8": ("bf16", "fp16"), "bf16": ("fp16",), "fp16": ("bf16",),
    "fp32": ("tf32",),
}

GB = 1e9


@dataclass(frozen=True)
class Efficiency:
    """What the estimate assumes beyond the peaks: the fraction of each peak attained,
    whether memory traffic overlaps arithmetic, and fixed costs. ``basis`` says why."""

    compute: float = 1.0
    bandwidth: float = 1.0
    overlap: bool = True  # roofline max(compute, memory); False: compute + memory
    per_layer_s: float = 0.0  # per decoder layer per forward step (norms, RoPE, dispatch)
    per_step_s: float = 0.0  # per forward step (scheduling, sampling)
    basis: str = ""

    def __post_init__(self) -> None:
        for name in ("compute", "bandwidth"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ConfigError(f"{name} efficiency must be in (0, 1], got {value}",
                                  "give the attained fraction of the peak, e.g. 0.8")
        if self.per_layer_s < 0 or self.per_step_s < 0:
            raise ConfigError("fixed overheads cannot be negative", "pass 0 or more")

    def to_dict(self) -> dict[str, Any]:
        return {"compute": self.compute, "bandwidth": self.bandwidth, "overlap": self.overlap,
                "per_layer_us": self.per_layer_s * 1e6, "per_step_ms": self.per_step_s * 1e3,
                "basis": self.basis}


# Datasheet peaks: the estimate is the roofline itself, a floor no engine beats.
DATASHEET = Efficiency(basis=(
    "datasheet peaks taken as attained and compute overlapped with memory traffic, no "
    "launch or step overhead (vLLM replays decode as CUDA graphs): a lower bound on time; "
    "pass --bandwidth-efficiency / --compute-efficiency / --overhead-us-per-layer to model "
    "a measured engine"))

# Probed CPU peaks (``llmctl hw probe``: an attained matmul rate and torch.sum's read
# bandwidth, so efficiency 1). Two fits on this repository's measurements (2 cores of an
# AMD EPYC, llmctl's engine):
# - no overlap: bf16 products over SmolLM2's linears took within 18% of
#   flops / F + bytes / B at every size from 1 to 2048 rows, while max(...) was 15-41%
#   short from 1 to 32 rows (results/gemm-roof-smollm2.json: F = 441.85 GFLOP/s,
#   B = 60.4 GB/s, 212 MB of weights);
# - 58 us per layer: batch-1 decode of the five llmctl sides of
#   results/lowbit-decode-smollm2.json (bf16, bf16 + int8 head, GGUF Q4_1, W4A16 and W4A16
#   + int8 head; 98-269 MB read per token) took a near-constant 1.2-1.9 ms (median 1.73)
#   beyond bytes / 35.1 GB/s + flops / 441.85 GFLOP/s, over 30 layers.
CPU_PROBED = Efficiency(overlap=False, per_layer_s=58e-6, basis=(
    "probed CPU peaks (attained rates); compute and memory time added, not overlapped, and "
    "58 us per layer per step for the work outside the matrix products: both fitted on "
    "llmctl's engine on a 2-core EPYC (results/gemm-roof-smollm2, "
    "results/lowbit-decode-smollm2)"))


@dataclass(frozen=True)
class Slo:
    """``STAT_METRIC_ms OP NUMBER``: STAT mean | median | pNN, METRIC ttft | tpot | itl."""

    text: str
    stat: str
    metric: str  # "ttft" | "tpot" ("itl" is the same step time here)
    op: str
    limit_ms: float

    def holds(self, value_ms: float) -> bool:
        return {"<=": value_ms <= self.limit_ms, "<": value_ms < self.limit_ms}[self.op]


_SLO = re.compile(r"^\s*(?P<stat>mean|median|p\d{1,2}(?:\.\d+)?)_(?P<metric>ttft|tpot|itl)_ms"
                  r"\s*(?P<op><=|<)\s*(?P<value>\d*\.?\d+(?:[eE][-+]?\d+)?)\s*$")


def parse_slos(text: str | None) -> tuple[Slo, ...]:
    """``'p95_ttft_ms<=500,p95_tpot_ms<=100'`` (comma-separated)."""
    if not text:
        return ()
    out = []
    for part in text.split(","):
        m = _SLO.match(part)
        if not m:
            raise ConfigError(f"cannot read SLO {part.strip()!r}",
                              "write e.g. 'p95_ttft_ms<=500,p95_tpot_ms<=100' (stat mean, "
                              "median or pNN; metric ttft, tpot or itl; <= or <)")
        metric = "tpot" if m["metric"] == "itl" else m["metric"]
        out.append(Slo(part.strip(), m["stat"], metric, m["op"], float(m["value"])))
    return tuple(out)


@dataclass(frozen=True)
class PlanOptions:
    """What ``llmctl plan`` is asked (vLLM's defaults where vLLM has one)."""

    tp: int = 1
    context: int = 8192
    prompt_len: int | None = None  # default: min(1024, context)
    kv_dtype: str = "bf16"
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 8192  # prefill chunk; the activation workspace's size
    max_num_seqs: int = 256
    slos: tuple[Slo, ...] = ()

    def __post_init__(self) -> None:
        for name in ("tp", "context", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}",
                                  f"pass --{name.replace('_', '-')} 1 or more")
        if self.prompt_len is not None and not 1 <= self.prompt_len <= self.context:
            raise ConfigError(f"prompt_len must be in 1..context ({self.context}), got "
                              f"{self.prompt_len}", "pass a --prompt-len within --context")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"unknown KV cache dtype {self.kv_dtype!r}",
                              "known: " + ", ".join(KV_DTYPES))
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization must be in (0, 1], got "
                              f"{self.gpu_memory_utilization}", "e.g. 0.9")

    @property
    def prompt(self) -> int:
        return self.prompt_len if self.prompt_len is not None else min(1024, self.context)


@dataclass(frozen=True)
class StepTime:
    """One forward step on one GPU: the work, the two roofline times and the estimate."""

    flops: float
    bytes: float
    compute_s: float  # at the attained compute rate (peak x efficiency)
    memory_s: float  # at the attained bandwidth
    overhead_s: float
    overlap: bool

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "bandwidth"

    @property
    def roofline_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def seconds(self) -> float:
        work = self.roofline_s if self.overlap else self.compute_s + self.memory_s
        return work + self.overhead_s

    def to_dict(self) -> dict[str, Any]:
        return {"flops": self.flops, "bytes": self.bytes, "compute_ms": self.compute_s * 1e3,
                "memory_ms": self.memory_s * 1e3, "overhead_ms": self.overhead_s * 1e3,
                "roofline_ms": self.roofline_s * 1e3, "bound": self.bound,
                "estimate_ms": self.seconds * 1e3}


@dataclass(frozen=True)
class Memory:
    device_bytes: float
    utilization: float
    weight_bytes: float  # per GPU
    activation_bytes: float
    kv_bytes_per_token: float  # per GPU
    context: int

    @property
    def budget_bytes(self) -> float:
        return self.device_bytes * self.utilization

    @property
    def kv_budget_bytes(self) -> float:
        return self.budget_bytes - self.weight_bytes - self.activation_bytes

    @property
    def kv_capacity_tokens(self) -> int:
        return max(0, math.floor(self.kv_budget_bytes / self.kv_bytes_per_token))

    @property
    def max_concurrency(self) -> int:
        """Sequences of ``context`` tokens the cache holds at once."""
        return self.kv_capacity_tokens // self.context

    @property
    def fits(self) -> bool:
        return self.max_concurrency >= 1

    def to_dict(self) -> dict[str, Any]:
        return {"device_bytes": self.device_bytes, "gpu_memory_utilization": self.utilization,
                "budget_bytes": self.budget_bytes, "weight_bytes": self.weight_bytes,
                "activation_bytes": self.activation_bytes,
                "kv_budget_bytes": self.kv_budget_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_capacity_tokens": self.kv_capacity_tokens, "context": self.context,
                "max_concurrency": self.max_concurrency, "fits": self.fits}


@dataclass(frozen=True)
class DecodeRow:
    batch: int
    step: StepTime

    @property
    def tpot_ms(self) -> float:
        return self.step.seconds * 1e3

    @property
    def output_tokens_per_s(self) -> float:
        return self.batch / self.step.seconds

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "tpot_ms": self.tpot_ms,
                "output_tokens_per_s": self.output_tokens_per_s, **self.step.to_dict()}


@dataclass(frozen=True)
class SloVerdict:
    met: bool
    ttft_ok: bool
    max_batch: int  # the largest batch whose TPOT meets every TPOT SLO (0: none)
    output_tokens_per_s: float  # at that batch
    failed: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"met": self.met, "ttft_ok": self.ttft_ok, "max_batch_within_slo": self.max_batch,
                "output_tokens_per_s_within_slo": self.output_tokens_per_s,
                "failed": list(self.failed)}


@dataclass(frozen=True)
class Suggestion:
    flag: str  # the command-line change, e.g. "--weights w4a16"
    text: str  # what it changes, in numbers
    fits: bool
    slo_met: bool | None
    fixes: bool  # it turns a failing plan into a passing one

    def to_dict(self) -> dict[str, Any]:
        return {"flag": self.flag, "text": self.text, "fits": self.fits, "slo_met": self.slo_met,
                "fixes": self.fixes}


@dataclass(frozen=True)
class Plan:
    arch: ArchSpec
    weights: WeightFormat
    options: PlanOptions
    peaks: Peaks
    compute_dtype: str
    efficiency: Efficiency
    cost: ModelCost
    memory: Memory
    prefill: StepTime  # the whole prompt (its chunks summed)
    prefill_chunks: int
    decode: tuple[DecodeRow, ...]
    slo: SloVerdict | None
    notes: tuple[str, ...]
    suggestions: tuple[Suggestion, ...] = ()

    @property
    def ttft_ms(self) -> float:
        return self.prefill.seconds * 1e3

    @property
    def ok(self) -> bool:
        return self.memory.fits and (self.slo is None or self.slo.met)

    def to_dict(self) -> dict[str, Any]:
        o, a, c = self.options, self.arch, self.cost
        return {
            "model": {"model_type": a.model_type, "layers": a.num_layers,
                      "hidden_size": a.hidden_size, "q_heads": a.num_heads,
                      "kv_heads": a.num_kv_heads, "head_dim": a.head_dim,
                      "experts": a.num_experts, "experts_per_token": a.experts_per_token,
                      "total_params": c.total_params, "matmul_params": c.matmul_params,
                      "active_params": c.active_params, "weight_bytes": c.weight_bytes,
                      "layer_windows": list(a.layer_windows) or None,
                      "kv_bytes_per_token_every_layer": c.kv_bytes_per_token},
            "weights": {"name": self.weights.name, "describe": self.weights.describe(),
                        "compute_dtype": self.compute_dtype},
            "kv_dtype": o.kv_dtype, "tp": o.tp, "context": o.context, "prompt_len": o.prompt,
            "hardware": self.peaks.to_dict(),
            "peak_flops": self.peaks.flops_for(self.compute_dtype),
            "peak_bandwidth": self.peaks.bandwidth,
            "efficiency": self.efficiency.to_dict(),
            "memory": self.memory.to_dict(),
            "ttft": {"prompt_len": o.prompt, "chunks": self.prefill_chunks,
                     "ttft_ms": self.ttft_ms, **self.prefill.to_dict()},
            "decode": [r.to_dict() for r in self.decode],
            "slo": None if self.slo is None else {"slos": [s.text for s in o.slos],
                                                  **self.slo.to_dict()},
            "fits": self.memory.fits, "ok": self.ok,
            "suggestions": [s.to_dict() for s in self.suggestions],
            "notes": list(self.notes),
        }


# --- the pieces ------------------------------------------------------------------------------
def activation_bytes(arch: ArchSpec, tp: int, tokens: int, max_num_seqs: int,
                     act_bytes: float = 2.0) -> float:
    """An estimate of the activation workspace vLLM's profiling run measures: the largest
    live set inside a block at ``tokens`` tokens (the residual and normed input,
    ``2 * hidden``; the q/k/v outputs; the MLP's gate and up outputs and their product,
    ``3 * width``, all split ``tp`` ways except the residual), plus float32 logits over the
    full vocabulary for ``max_num_seqs`` rows. An estimate, not a measurement: vLLM's
    profiling run also sees allocator fragmentation and CUDA graph pools, left out here."""
    width = arch.intermediate_size  # a dense block's, and a MoE block's k experts + shared
    if arch.is_moe:
        width = max(width, arch.experts_per_token * arch.expert_intermediate_size
                    + arch.shared_expert_intermediate_size)
    per_token = 2 * arch.hidden_size + (arch.q_width + 2 * arch.kv_width + 3 * width) / tp
    return tokens * per_token * act_bytes + max_num_seqs * arch.vocab_size * 4


def kv_heads_per_gpu(arch: ArchSpec, tp: int) -> int:
    if arch.num_heads % tp:
        raise ConfigError(f"tp {tp} does not divide the {arch.num_heads} attention heads",
                          "pick a --tp that divides num_attention_heads")
    if arch.num_kv_heads % tp and tp % arch.num_kv_heads:
        raise ConfigError(f"tp {tp} and the {arch.num_kv_heads} KV heads do not divide "
                          "either way", "pick a --tp that divides num_key_value_heads or a "
                          "multiple of it")
    return max(1, arch.num_kv_heads // tp)


def compute_dtype(weights: WeightFormat, peaks: Peaks) -> tuple[str, str | None]:
    """The dtype whose peak the products are timed against, and a note when it is not
    the weights' own (no such peak on this hardware)."""
    want = weights.compute_dtype
    if peaks.flops_for(want):
        return want, None
    for alt in COMPUTE_FALLBACK.get(want, ()):
        if peaks.flops_for(alt):
            return alt, f"no {want} peak for this hardware: products timed at the {alt} peak"
    raise ConfigError(f"no {want} FLOP/s peak for this hardware ({peaks.source})",
                      "pass --peak-flops")


def _step(flops: float, nbytes: float, overhead: float, peak_flops: float,
          peak_bandwidth: float, eff: Efficiency) -> StepTime:
    return StepTime(flops, nbytes, flops / (peak_flops * eff.compute),
                    nbytes / (peak_bandwidth * eff.bandwidth), overhead, eff.overlap)


def batch_sizes(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit``, and ``limit`` itself (at least [1])."""
    limit = max(1, limit)
    sizes = [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]
    return sizes if sizes[-1] == limit else [*sizes, limit]


def judge_slos(slos: tuple[Slo, ...], ttft_ms: float,
               decode: tuple[DecodeRow, ...]) -> SloVerdict | None:
    if not slos:
        return None
    ttft_failed = [s.text for s in slos if s.metric == "ttft" and not s.holds(ttft_ms)]
    tpot_slos = [s for s in slos if s.metric == "tpot"]
    passing = [r for r in decode if all(s.holds(r.tpot_ms) for s in tpot_slos)]
    best = passing[-1] if passing else None
    failed = list(ttft_failed)
    if best is None:
        failed += [s.text for s in tpot_slos]
    return SloVerdict(not failed, not ttft_failed, best.batch if best else 0,
                      best.output_tokens_per_s if best else 0.0, tuple(failed))


# --- the plan --------------------------------------------------------------------------------
def make_plan(arch: ArchSpec, weights: WeightFormat, peaks: Peaks, options: PlanOptions,
              efficiency: Efficiency = DATASHEET, *, suggest: bool = True) -> Plan:
    """Memory, TTFT and TPOT of ``arch`` stored as ``weights`` on ``options.tp`` devices
    with ``peaks``; with ``suggest``, variants that fix a plan that fails."""
    o, tp = options, options.tp
    if peaks.bandwidth is None:
        raise ConfigError(f"no memory bandwidth for this hardware ({peaks.source})",
                          "pass --peak-bandwidth")
    if peaks.memory_bytes is None:
        raise ConfigError(f"no memory size for this hardware ({peaks.source})",
                          "pass --memory-gb")
    dtype, dtype_note = compute_dtype(weights, peaks)
    flops_peak, bw = peaks.flops_for(dtype), peaks.bandwidth
    cost = ModelCost(arch, weights, KV_DTYPES[o.kv_dtype])
    kv_share = kv_heads_per_gpu(arch, tp) / arch.num_kv_heads  # of the model's KV per GPU
    # per token of a sequence of the planned context: sliding-window layers hold at most W
    kv_per_token = cost.sequence_kv_bytes(o.context) / o.context * kv_share
    memory = Memory(float(peaks.memory_bytes), o.gpu_memory_utilization, cost.weight_bytes / tp,
                    activation_bytes(arch, tp, o.max_num_batched_tokens, o.max_num_seqs),
                    kv_per_token, o.context)
    fixed = arch.num_layers * efficiency.per_layer_s + efficiency.per_step_s

    # prefill in chunks of max_num_batched_tokens; logits (the lm_head) in the last only
    prompt, chunk = o.prompt, o.max_num_batched_tokens
    flops = nbytes = overhead = 0.0
    starts = list(range(0, prompt, chunk))
    for start in starts:
        end = min(prompt, start + chunk)
        flops += cost.prefill_flops(end, start) - (2 * cost.lm_head_params if end < prompt else 0)
        weights_read = cost.weight_bytes_read(end - start)
        nbytes += weights_read / tp + (cost.prefill_bytes(end, start) - weights_read) * kv_share
        overhead += fixed
    # the chunks run one after another: summing their times = timing the summed work,
    # except where a chunk changes bound; close enough for chunks of equal shape
    prefill = _step(flops / tp, nbytes, overhead, flops_peak, bw, efficiency)

    rows = []
    for batch in batch_sizes(min(memory.max_concurrency, o.max_num_seqs)):
        lens = [o.context] * batch
        step_bytes = (cost.weight_bytes_read(batch) / tp
                      + sum(cost.sequence_kv_bytes(c) for c in lens) * kv_share)
        rows.append(DecodeRow(batch, _step(cost.decode_step_flops(lens) / tp, step_bytes, fixed,
                                           flops_peak, bw, efficiency)))
    decode = tuple(rows)
    notes = [*arch.notes, *([dtype_note] if dtype_note else [])]
    if arch.max_position_embeddings and o.context > arch.max_position_embeddings:
        notes.append(f"context {o.context} exceeds the model's max_position_embeddings "
                     f"{arch.max_position_embeddings}")
    if tp > 1:
        notes.append("tensor-parallel all-reduces (2 per layer) are not modelled")
    if not memory.fits:
        notes.append("does not fit: TTFT/TPOT are shown for batch 1 as if it did")
    plan = Plan(arch, weights, o, peaks, dtype, efficiency, cost, memory, prefill, len(starts),
                decode, judge_slos(o.slos, prefill.seconds * 1e3, decode), tuple(notes))
    if suggest and not plan.ok:
        plan = replace(plan, suggestions=tuple(suggestions(plan)))
    return plan


# --- suggestions -----------------------------------------------------------------------------
_WEIGHT_LADDER = ("fp8", "int8", "w8a16", "w4a16")
_TP_LADDER = (2, 4, 8)


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB"


def _verdict(p: Plan) -> str:
    if not p.memory.fits:
        return "still does not fit"
    words = [(f"fits, KV for {p.memory.kv_capacity_tokens:,} tokens "
             f"({p.memory.max_concurrency} sequences of {p.options.context})")]
    if p.slo is not None and p.slo.met:
        words.append(f"meets the SLOs up to batch {p.slo.max_batch}")
    elif p.slo is not None:
        words.append("misses " + ", ".join(p.slo.failed))
    return "; ".join(words)


def suggestions(plan: Plan) -> list[Suggestion]:
    """Each variant planned again: weight formats smaller than the current one (one per
    size), an 8-bit KV cache (when the weights leave room for one), and the smallest larger
    ``tp`` that fits (and meets the SLOs, if one does). When none fixes the plan alone, the
    smallest ``tp`` with the least aggressive format that does. Fixes come first."""
    out: list[Suggestion] = []

    def again(weights: WeightFormat | None = None, **changes: Any) -> Plan | None:
        try:
            return make_plan(plan.arch, weights or plan.weights, plan.peaks,
                             replace(plan.options, **changes), plan.efficiency, suggest=False)
        except ConfigError:  # e.g. a tp that does not divide the heads: no suggestion
            return None

    def add(flag: str, variant: Plan, change: str) -> None:
        slo_met = None if variant.slo is None else variant.slo.met
        out.append(Suggestion(flag, f"{flag}: {change}; {_verdict(variant)}",
                              variant.memory.fits, slo_met, variant.ok))

    def weights_change(variant: Plan) -> str:
        return (f"weights {_gb(plan.memory.weight_bytes)} -> {_gb(variant.memory.weight_bytes)} "
                f"per GPU, TPOT at batch 1 {plan.decode[0].tpot_ms:.1f} -> "
                f"{variant.decode[0].tpot_ms:.1f} ms")

    smaller = {}  # weight bytes -> (name, format): formats of one size are one suggestion
    for name in _WEIGHT_LADDER:
        fmt = NAMED[name]
        size = round(ModelCost(plan.arch, fmt).weight_bytes, -6)
        if size < plan.cost.weight_bytes * 0.95:
            smaller.setdefault(size, (name, fmt))
    for name, fmt in smaller.values():
        variant = again(fmt)
        if variant is not None:
            add(f"--weights {name}", variant, weights_change(variant))
    if KV_DTYPES[plan.options.kv_dtype] > 1 and plan.memory.kv_budget_bytes > 0:
        variant = again(kv_dtype="fp8")
        if variant is not None:
            add("--kv-dtype fp8", variant,
                f"KV per token {plan.memory.kv_bytes_per_token / 1024:.0f} -> "
                f"{variant.memory.kv_bytes_per_token / 1024:.0f} KiB per GPU, capacity "
                f"{plan.memory.kv_capacity_tokens:,} -> {variant.memory.kv_capacity_tokens:,} "
                "tokens")
    larger = [tp for tp in _TP_LADDER if tp > plan.options.tp]
    tried = [(tp, v) for tp in larger if (v := again(tp=tp)) is not None]
    chosen = (next(((tp, v) for tp, v in tried if v.ok), None)
              or next(((tp, v) for tp, v in tried if v.memory.fits), None)
              or (tried[-1] if tried else None))
    if chosen is not None:
        tp, variant = chosen
        add(f"--tp {tp}", variant,
            f"weights {_gb(plan.memory.weight_bytes)} -> {_gb(variant.memory.weight_bytes)} per "
            f"GPU, TTFT {plan.ttft_ms:.0f} -> {variant.ttft_ms:.0f} ms, TPOT at batch 1 "
            f"{plan.decode[0].tpot_ms:.1f} -> {variant.decode[0].tpot_ms:.1f} ms")
    if not any(s.fixes for s in out):
        for tp in larger:
            combo = next(((name, v) for name, fmt in smaller.values()
                          if (v := again(fmt, tp=tp)) is not None and v.ok), None)
            if combo is not None:
                name, variant = combo
                add(f"--tp {tp} --weights {name}", variant, weights_change(variant))
                break
    out.sort(key=lambda s: (not s.fixes, not s.fits))
    return out
