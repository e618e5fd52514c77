"""A run's utilization (MFU/MBU per phase), the bottleneck verdict per phase and its cost
in dollars: the report's ``utilization``, ``verdicts`` and ``cost`` sections and their
flat keys (``prefill_mfu``, ``decode_mbu``, ``cost_usd_per_1m_output_tokens``, ...),
which ``--gate`` and ``bench compare`` see like any other metric.

The arithmetic is :mod:`llmctl.perf`'s; this module only gathers its inputs from a run:
the model's config.json (FLOPs and bytes), the peaks (``--hardware``, ``--peak-flops``,
``--peak-bandwidth``, else this GPU from the table or this CPU's cached probe), and the
per-phase loads from the server's own counters when it is llmctl, else from the client's
records (:mod:`llmctl.perf.utilization` says how and which way each is biased).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from llmctl.errors import ConfigError
from llmctl.perf import money, verdicts
from llmctl.perf.utilization import PHASES, Timed, from_counters, from_requests, report, use
from llmctl.utils.dtypes import short_name


@dataclass(frozen=True)
class PerfSettings:
    """What the user said about the hardware and its price (CLI flags)."""

    hardware: str | None = None
    peak_flops: float | None = None
    peak_bandwidth: float | None = None
    cost_per_hour: float | None = None


def _timed(records) -> list[Timed]:
    return [Timed(r.input_tokens, r.output_tokens or 0, r.start, r.ttft, r.latency, r.itl)
            for r in records if r.success and r.start is not None and r.ttft is not None
            and r.latency is not None and (r.output_tokens or 0) > 0]


def _served_dtype(dtype: str, config: dict) -> str | None:
    """The dtype the products run in, by its short name (``bf16``). ``auto`` resolves as
    llmctl serve resolves it on this host; a remote server's dtype is its own business, so
    give ``--dtype`` when it is not the checkpoint's."""
    if dtype == "auto":
        from llmctl.utils.device import default_device, resolve_dtype

        dtype = resolve_dtype("auto", device=default_device(),
                              model_dtype=lambda: config.get("torch_dtype")).dtype
    return short_name(dtype)


def diagnose(settings: PerfSettings, *, model_path, dtype: str, records: Sequence,
             duration: float, server_summary: dict, flat: dict, slos: dict,
             shared_prefix_tokens: int) -> dict:
    """The three report sections plus ``flat`` keys; ``{"utilization": {"available":
    False, "reason": ...}}`` when the model's architecture is unknown."""
    from llmctl.perf.costs import ModelCost
    from llmctl.perf.hardware import resolve_peaks
    from llmctl.perf.weight_format import WeightFormat

    if model_path is None:
        return {"utilization": {"available": False, "reason": "no model config: pass --model "
                                "(a local checkpoint or the embedded alias) to get MFU/MBU"}}
    try:
        config = json.loads((model_path / "config.json").read_text())
        kind = _served_dtype(dtype, config)
        cost = ModelCost.from_config(config, kv_bytes=4.0 if kind == "fp32" else 2.0)
        w4 = ModelCost(cost.arch, WeightFormat.from_name("w4a16"), cost.kv_bytes)
    except (OSError, ValueError, ConfigError) as exc:
        return {"utilization": {"available": False, "reason": str(exc)}}
    peaks = resolve_peaks(settings.hardware, peak_flops=settings.peak_flops, dtype=kind,
                          peak_bandwidth=settings.peak_bandwidth)
    timed = _timed(records)
    loads = from_counters(server_summary) if server_summary.get("available") else None
    source = "engine counters (llmctl serve /metrics)"
    if loads is None:
        loads, source = from_requests(timed, cost), "client records (estimates; see formulas)"
    util = report(loads, peaks, kind, source)
    out_flat = {f"{p}_{k}": util["phases"][p][k] for p in PHASES for k in ("mfu", "mbu")
                if util["phases"][p][k] is not None}

    # decode steps from the client's median gap (the engine does not count them by phase)
    gaps = [g for t in timed for g in t.itl]
    steps = loads["decode"].seconds / statistics.median(gaps) if gaps else 0.0
    kv_per_step = (max(loads["decode"].bytes - steps * cost.weight_bytes_read_per_step, 0.0)
                   / steps if steps else 0.0)
    prompts = [t.prompt_len for t in timed]
    mean_prompt = statistics.fmean(prompts) if prompts else 0.0
    peak = peaks.flops_for(kind) if peaks else None
    low = max((peaks.flops_for(d) or 0.0) for d in ("fp8", "int8")) if peaks else 0.0
    verdict_rows = []
    for phase in PHASES:
        u = use(phase, loads[phase], peaks, kind)
        bound = verdicts.bound_of(u.mfu, u.mbu)
        if bound is None:
            continue
        verdict_rows.append(verdicts.verdict(verdicts.Situation(
            phase, bound, mfu=u.mfu, mbu=u.mbu,
            weight_bits=cost.weight_bytes * 8 / max(cost.total_params, 1),
            weight_bytes_per_step=cost.weight_bytes_read_per_step,
            kv_bytes_per_step=kv_per_step, kv_bytes_per_element=cost.kv_bytes,
            w4_weight_bytes_per_step=w4.weight_bytes_read_per_step,
            prefix_hit_rate=server_summary.get("prefix_cache_hit_rate"),
            shared_prefix_tokens=shared_prefix_tokens, mean_prompt_tokens=mean_prompt,
            ttft_p95_ms=flat.get("p95_ttft_ms"), ttft_slo_ms=slos.get("ttft_ms"),
            roof_ttft_ms=(cost.prefill_flops(round(mean_prompt)) / peak * 1e3
                          if peak and mean_prompt >= 1 else None),
            low_precision_speedup=low / peak if peak and low > peak else None)))
    sections = {"utilization": {"available": True, **util}, "verdicts": verdict_rows}
    if settings.cost_per_hour is not None:
        busy = loads["prefill"].seconds + loads["decode"].seconds
        cost_section = money.cost_report(
            settings.cost_per_hour, duration, input_tokens=int(flat.get("total_input_tokens")
                                                               or 0),
            output_tokens=int(flat.get("total_output_tokens") or 0),
            requests=int(flat.get("completed") or 0),
            prefill_share=loads["prefill"].seconds / busy if busy > 0 else None)
        sections["cost"] = cost_section
        out_flat.update(money.flat(cost_section))
    sections["flat"] = out_flat
    return sections
