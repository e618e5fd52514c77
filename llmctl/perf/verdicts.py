"""What bounds each phase, and what to do next: a decision table kept as data.

A phase is **compute-bound** when its MFU reaches :data:`ROOF_FRACTION` (and exceeds its
MBU), **bandwidth-bound** when its MBU does, and **overhead-bound** when neither: the
time goes to neither the matrix units nor memory but to scheduling, dispatch, the
network or idling. Half the roof is the line because tuned kernels reach 60-90% of it
(this repo's bf16 GEMM: 92% of the compute roof; batch-1 decode: 77% of the read
bandwidth), so a phase under half of both is held back by something else.

Each :class:`Rule` names the phase and bound it applies to, a condition on the
:class:`Situation`, the advice, and the expected gain computed from the same cost model
that gave the utilization (bytes or FLOPs before over after), so the advice is never a
bare "try X".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

ROOF_FRACTION = 0.5
BOUNDS = ("compute", "bandwidth", "overhead")


def bound_of(mfu: float | None, mbu: float | None) -> str | None:
    """The phase's bound, or None when neither utilization is known."""
    if mfu is None and mbu is None:
        return None
    f, b = mfu or 0.0, mbu or 0.0
    if max(f, b) < ROOF_FRACTION:
        return "overhead"
    return "compute" if f >= b else "bandwidth"


@dataclass(frozen=True)
class Situation:
    """What the rules may look at, for one phase of one run."""

    phase: str
    bound: str
    mfu: float | None = None
    mbu: float | None = None
    weight_bits: float = 16.0  # bits per weight as stored (group scales included)
    weight_bytes_per_step: float = 0.0  # decode: weights read per step
    kv_bytes_per_step: float = 0.0  # decode: KV read per step at the mean batch
    kv_bytes_per_element: float = 2.0
    w4_weight_bytes_per_step: float | None = None  # the same weights at 4.125 bits
    prefix_hit_rate: float | None = None  # server-side, tokens
    shared_prefix_tokens: int = 0  # the workload's shared prefix per prompt
    mean_prompt_tokens: float = 0.0
    ttft_p95_ms: float | None = None
    ttft_slo_ms: float | None = None
    roof_ttft_ms: float | None = None  # the mean prompt's prefill at the compute roof
    low_precision_speedup: float | None = None  # peak fp8 (or int8) over the run's dtype


@dataclass(frozen=True)
class Advice:
    rule: str
    text: str
    expected_gain: float | None  # x faster for the phase, per the cost model
    gain_basis: str

    def to_dict(self) -> dict:
        return {"rule": self.rule, "advice": self.text, "expected_gain": self.expected_gain,
                "gain_basis": self.gain_basis}


@dataclass(frozen=True)
class Rule:
    name: str
    phase: str | None  # None: either phase
    bounds: tuple[str, ...]
    applies: Callable[[Situation], bool]
    advice: Callable[[Situation], str]
    gain: Callable[[Situation], float | None]
    basis: str


def _decode_bytes(s: Situation) -> float:
    return s.weight_bytes_per_step + s.kv_bytes_per_step


def _w4_gain(s: Situation) -> float | None:
    if not s.w4_weight_bytes_per_step:
        return None
    return _decode_bytes(s) / (s.w4_weight_bytes_per_step + s.kv_bytes_per_step)


def _kv8_gain(s: Situation) -> float:
    kv8 = s.kv_bytes_per_step / s.kv_bytes_per_element
    return _decode_bytes(s) / (s.weight_bytes_per_step + kv8)


def _prefix_gain(s: Situation) -> float | None:
    rest = s.mean_prompt_tokens - s.shared_prefix_tokens
    return s.mean_prompt_tokens / rest if rest > 0 else None


def _headroom(s: Situation) -> float | None:
    best = max(s.mfu or 0.0, s.mbu or 0.0)
    return ROOF_FRACTION / best if best > 0 else None


RULES: tuple[Rule, ...] = (
    Rule("decode-4bit-weights", "decode", ("bandwidth",),
         lambda s: s.weight_bits > 5 and (_w4_gain(s) or 0) > 1.05,
         lambda s: f"4-bit weights (w4a16: GPTQ or AWQ) cut the bytes read per decode step "
                   f"{_w4_gain(s):.1f}x ({_decode_bytes(s) / 1e6:.0f} -> "
                   f"{_decode_bytes(s) / _w4_gain(s) / 1e6:.0f} MB)",
         _w4_gain, "bytes per decode step before / after, KV unchanged"),
    Rule("decode-8bit-kv", "decode", ("bandwidth",),
         lambda s: s.kv_bytes_per_element >= 2 and s.kv_bytes_per_step
         >= 0.3 * _decode_bytes(s),
         lambda s: f"an 8-bit KV cache (--kv-cache-dtype fp8) halves the KV reads, "
                   f"{s.kv_bytes_per_step / _decode_bytes(s):.0%} of each decode step's bytes",
         _kv8_gain, "bytes per decode step before / after, weights unchanged"),
    Rule("decode-overhead", "decode", ("overhead",), lambda s: True,
         lambda s: "decode is neither compute- nor bandwidth-bound: per-step overhead "
                   "(scheduling, dispatch, sampling, the HTTP side) or too small a batch; "
                   "raise concurrency (max_num_seqs) or cut per-step work (CUDA graphs, "
                   "fused layers)",
         _headroom, "half the nearest roof / the achieved fraction of it"),
    Rule("decode-compute", "decode", ("compute",), lambda s: True,
         lambda s: "decode is compute-bound (a large batch): speculative decoding will not "
                   "pay; lower-precision products would"
                   + (f" (fp8/int8 peak {s.low_precision_speedup:.1f}x)"
                      if s.low_precision_speedup else ""),
         lambda s: s.low_precision_speedup, "peak FLOP/s at the lower precision / now"),
    Rule("prefill-prefix-cache", "prefill", BOUNDS,
         lambda s: s.shared_prefix_tokens > 0 and not s.prefix_hit_rate,
         lambda s: f"the prompts share a {s.shared_prefix_tokens}-token prefix but the prefix "
                   "cache hit nothing: enable prefix caching (--prefix-caching / vLLM's "
                   "--enable-prefix-caching)",
         _prefix_gain, "prompt tokens / tokens left to compute"),
    Rule("prefill-ttft-over-slo", "prefill", BOUNDS,
         lambda s: (s.ttft_slo_ms is not None and s.ttft_p95_ms is not None
                    and s.ttft_p95_ms > s.ttft_slo_ms),
         lambda s: f"p95 TTFT {s.ttft_p95_ms:.0f} ms is over the {s.ttft_slo_ms:.0f} ms SLO: "
                   "a smaller chunked-prefill budget (max_num_batched_tokens) keeps decode "
                   "from starving new prompts; a prefix cache skips shared prompt tokens"
                   + (f"; at the compute roof the mean prompt takes {s.roof_ttft_ms:.0f} ms"
                      if s.roof_ttft_ms is not None else ""),
         lambda s: (s.ttft_p95_ms / s.roof_ttft_ms if s.roof_ttft_ms else None),
         "p95 TTFT / the mean prompt's prefill time at the compute roof"),
    Rule("prefill-overhead", "prefill", ("overhead",), lambda s: True,
         lambda s: "prefill is neither compute- nor bandwidth-bound: too few prompt tokens "
                   "per step (raise max_num_batched_tokens) or time spent queueing",
         _headroom, "half the nearest roof / the achieved fraction of it"),
    Rule("prefill-compute", "prefill", ("compute",), lambda s: True,
         lambda s: "prefill is compute-bound: fewer FLOPs per prompt token (prefix caching "
                   "of shared prefixes) or lower-precision products"
                   + (f" (peak {s.low_precision_speedup:.1f}x)" if s.low_precision_speedup
                      else ""),
         lambda s: s.low_precision_speedup, "peak FLOP/s at the lower precision / now"),
)


def advise(s: Situation) -> list[Advice]:
    """Every rule of the table that applies to ``s``, in table order."""
    out = []
    for rule in RULES:
        if rule.phase not in (None, s.phase) or s.bound not in rule.bounds:
            continue
        if rule.applies(s):
            gain = rule.gain(s)
            out.append(Advice(rule.name, rule.advice(s),
                              None if gain is None else round(gain, 3), rule.basis))
    return out


def verdict(s: Situation) -> dict:
    """The report's verdict for one phase: its bound and the advice."""
    return {"phase": s.phase, "bound": s.bound, "mfu": s.mfu, "mbu": s.mbu,
            "roof_fraction": ROOF_FRACTION, "next": [a.to_dict() for a in advise(s)]}
