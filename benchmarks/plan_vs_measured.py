"""Does ``llmctl plan`` predict llmctl's own decode on this machine?

Cases: SmolLM2-135M in bf16 (the float checkpoint of the embedded GGUF) and its W4A16
checkpoint (``llmctl quantize`` GPTQ, symmetric, group 64: the one
``benchmarks/lowbit_decode.py`` makes and keeps), each at decode batch 1 and 16.

Measured: llmctl's engine (``LLM(dtype="bfloat16")``, bf16 KV cache, 2 threads), one
process per case per round, the cases alternating in every round after a warm-up
generation. ``batch`` prompts of 32 tokens (windows of stdlib prose) are submitted at
once and stepped until every sequence has its first token; the next ``--decode-tokens``
steps, in which every sequence adds one token, are timed one by one; TPOT is their median
(the context grows from 33 to 32 + decode tokens over them).

Estimated: :func:`llmctl.perf.plan.make_plan` on the model's config, with this machine's
probed peaks (``llmctl.perf.probe_record.cached_peaks()``; ``llmctl hw probe`` is run when none
are cached, or ``--peaks-json`` names a ``Peaks.to_dict()`` file), the CPU efficiency
model :data:`llmctl.perf.plan.CPU_PROBED` (compute + memory time + a fixed cost per
layer, its parameters printed in the report) and every sequence at the mean context of
the timed steps. Beside it, the same estimate with the read bandwidth measured in the
round itself (``torch.sum`` over 512 MiB, as lowbit_decode measures it): this VM's read
bandwidth has been seen anywhere from 35 to 60 GB/s between runs, so a probe cached on
another day can be off by that much on its own. And the weight bytes one step of the
engine really reads (``decode_bytes.llmctl_model_reads``) next to the plan's count, which
is the checkpoint's layout (llmctl's int4 CPU kernel keeps its scales and zeros in
another one).

Verdict per case: estimate / measured within 35% (0.65 to 1.35).

    python benchmarks/plan_vs_measured.py --rounds 3
    python benchmarks/plan_vs_measured.py --rounds 1 --decode-tokens 8 --batches 1,2 \\
        --peaks-json /tmp/peaks.json --out-dir /tmp/pvm     # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common

PROMPT_TOKENS, DECODE_TOKENS, BATCHES = 32, 64, (1, 16)
TOLERANCE = 0.35
CASES = ("bf16", "w4a16")


# --- the worker: one case in its own process ------------------------------------------------
def worker(cfg: dict) -> dict:
    from decode_bytes import bytes_read_per_token, llmctl_model_reads
    from lowbit_decode import read_bandwidth

    from llmctl.serve.core.sampling_params import SamplingParams
    from llmctl.serve.engine.llm import LLM

    batch, n = cfg["batch"], cfg["decode_tokens"]
    llm = LLM(cfg["model"], dtype="bfloat16", kv_cache_memory="256MiB", max_num_seqs=batch,
              max_model_len=PROMPT_TOKENS + n + 8, enable_prefix_caching=False)
    prompts = cfg["prompts"][:batch]
    params = SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine = llm.engine
    ids = [f"pvm-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    started: set[str] = set()
    steps: list[float] = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        wall = time.perf_counter() - t0
        new = {o.request_id: len(o.outputs[0].new_token_ids) for o in outs}
        # a decode step: every sequence was already decoding and added exactly one token
        if started >= set(ids) and len(new) == batch and set(new.values()) == {1}:
            steps.append(wall)
        started.update(r for r, k in new.items() if k)
    model = engine.target.model
    return {"step_s": steps, "engine_weight_bytes_per_step":
            bytes_read_per_token(llmctl_model_reads(model)),
            "read_bandwidth_bytes_s": read_bandwidth()}


def spawn(cfg: dict, threads: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)],
                          capture_output=True, text=True, env=common.thread_env(threads),
                          check=False)
    if proc.returncode != 0:
        return {"error": proc.stderr[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- the estimate -----------------------------------------------------------------------------
def probed_peaks(peaks_json: str | None):
    """This machine's peaks: a file, the probe's cache, or a fresh ``llmctl hw probe``."""
    from llmctl.perf.peaks import Peaks

    if peaks_json:
        return Peaks.from_dict(json.loads(Path(peaks_json).read_text()))
    from llmctl.perf.probe_record import cached_peaks

    peaks = cached_peaks()
    if peaks is None:
        print("[plan-vs-measured] no cached peaks: running `llmctl hw probe`", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "llmctl", "hw", "probe"], check=True)
        peaks = cached_peaks()
    if peaks is None:
        raise SystemExit("error: `llmctl hw probe` cached no peaks")
    return peaks


def estimate(config: dict, peaks, batch: int, context: int, bandwidth: float | None = None):
    """The plan's decode row for ``batch`` sequences of ``context`` tokens."""
    import os
    from dataclasses import replace

    from llmctl.perf.arch import ArchSpec
    from llmctl.perf.plan import CPU_PROBED, PlanOptions, make_plan
    from llmctl.perf.weight_format import WeightFormat

    if peaks.memory_bytes is None:  # the plan needs a size; RAM it is
        peaks = replace(peaks, memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf(
            "SC_PHYS_PAGES"))
    peaks = peaks.with_overrides(bandwidth=bandwidth)
    plan = make_plan(ArchSpec.from_config(config), WeightFormat.from_config(config), peaks,
                     PlanOptions(context=context, prompt_len=PROMPT_TOKENS, max_num_seqs=batch),
                     CPU_PROBED, suggest=False)
    row = next(r for r in plan.decode if r.batch == batch)
    return plan, row


# --- the report -------------------------------------------------------------------------------
def summarize(rounds: list[dict], configs: dict, peaks, batches, context: int) -> dict:
    out = {}
    for case in CASES:
        for batch in batches:
            recs = [r for r in rounds if r["case"] == case and r["batch"] == batch
                    and r.get("step_s")]
            if not recs:
                continue
            per_round = [statistics.median(r["step_s"]) for r in recs]
            measured = statistics.median(per_round)
            plan, row = estimate(configs[case], peaks, batch, context)
            bw = statistics.median(r["read_bandwidth_bytes_s"] for r in recs)
            _, row_bw = estimate(configs[case], peaks, batch, context, bandwidth=bw)
            ratio, ratio_bw = row.step.seconds / measured, row_bw.step.seconds / measured
            out[f"{case} batch {batch}"] = {
                "case": case, "batch": batch, "measured_tpot_ms": measured * 1e3,
                "round_tpot_ms": [x * 1e3 for x in per_round],
                "estimate": row.to_dict(), "ratio": ratio,
                "within": abs(ratio - 1) <= TOLERANCE,
                "round_read_bandwidth_gb_s": bw / 1e9,
                "estimate_round_bandwidth": row_bw.to_dict(), "ratio_round_bandwidth": ratio_bw,
                "plan_weight_bytes_per_step": plan.cost.weight_bytes_read(batch),
                "engine_weight_bytes_per_step": recs[0]["engine_weight_bytes_per_step"],
                "weights": plan.weights.describe()}
    return out


def render(report: dict) -> str:
    lines = common.header_markdown(report, "llmctl plan vs measured decode (SmolLM2-135M)")
    m = report["model"]
    peaks = m["peaks"]
    lines += [
        (f"Estimate: `llmctl plan --hardware this` arithmetic with the probed peaks "
         f"({peaks['source']}: bf16 {peaks['flops'].get('bf16', 0) / 1e9:.0f} GFLOP/s, read "
         f"{(peaks['bandwidth'] or 0) / 1e9:.1f} GB/s), every sequence at {m['context']} "
         f"tokens (the mean context of the timed steps); efficiency: "
         f"{'max' if m['efficiency']['overlap'] else 'compute + memory'}, compute "
         f"{m['efficiency']['compute']:g}, bandwidth {m['efficiency']['bandwidth']:g}, "
         f"{m['efficiency']['per_layer_us']:g} us per layer ({m['efficiency']['basis']})."),
        "", (f"Measured: median decode step of llmctl's engine (bf16, {report['threads']} "
             f"threads) over {report['config']['decode_tokens']} steps, median over rounds. "
             f"Verdict: estimate / measured within {TOLERANCE:.0%}."), "",
        ("| case | batch | measured TPOT ms (rounds) | estimate ms (bound: compute / memory / "
        "fixed) | estimate / measured | within 35% | with the round's bandwidth (GB/s): "
        "estimate ms, ratio | weight MB per step: plan / engine |"),
        "|---|---|---|---|---|---|---|---|"]
    for r in report["summary"].values():
        e, eb = r["estimate"], r["estimate_round_bandwidth"]
        rounds = " / ".join(f"{x:.2f}" for x in r["round_tpot_ms"])
        lines.append(
            f"| {r['case']} | {r['batch']} | {r['measured_tpot_ms']:.2f} ({rounds}) | "
            f"{e['estimate_ms']:.2f} ({e['bound']}: {e['compute_ms']:.2f} / "
            f"{e['memory_ms']:.2f} / {e['overhead_ms']:.2f}) | {r['ratio']:.2f} | "
            f"{'yes' if r['within'] else 'NO'} | ({r['round_read_bandwidth_gb_s']:.1f}) "
            f"{eb['estimate_ms']:.2f}, {r['ratio_round_bandwidth']:.2f} | "
            f"{r['plan_weight_bytes_per_step'] / 1e6:.1f} / "
            f"{r['engine_weight_bytes_per_step'] / 1e6:.1f} |")
    within = sum(r["within"] for r in report["summary"].values())
    lines += ["", f"{within} of {len(report['summary'])} cases within {TOLERANCE:.0%}.",
              "", "Per-round records (load, other processes' CPU, every step) are in the JSON."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--peaks-json", help="a Peaks.to_dict() file instead of the probe's cache")
    common.add_run_arguments(ap)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    from engine_bench import corpus_ids
    from lowbit_decode import gptq_checkpoint

    from llmctl.home import models_dir
    from llmctl.models.loading import load_tokenizer
    from llmctl.models.resolve import resolve_model
    from llmctl.perf.model_config import load_model_config

    batches = [int(b) for b in args.batches.split(",")]
    out_dir = Path(args.out_dir)
    context = PROMPT_TOKENS + (args.decode_tokens + 1) // 2
    report = common.start_run("plan-vs-measured", {
        "rounds": args.rounds, "prompt_tokens": PROMPT_TOKENS,
        "decode_tokens": args.decode_tokens, "batches": batches, "context": context},
        allow_dirty=args.allow_dirty, threads=args.threads, out=out_dir)
    peaks = probed_peaks(args.peaks_json)
    resolved = resolve_model("smollm2-135m")
    w4 = gptq_checkpoint(resolved.path, models_dir() / f"{resolved.path.name}-w4a16-g64-gptq",
                         args.threads)
    models = {"bf16": str(resolved.path), "w4a16": str(w4)}
    configs = {case: load_model_config(path)[0] for case, path in models.items()}
    ids = corpus_ids(load_tokenizer(resolved.path))
    prompts = [ids[1000 + 97 * i:1000 + 97 * i + PROMPT_TOKENS] for i in range(max(batches))]
    rounds = []
    for rnd in range(args.rounds):
        order = [(c, b) for c in CASES for b in batches]
        for case, batch in (order if rnd % 2 == 0 else order[::-1]):
            record = {"name": f"{case} batch {batch} round {rnd + 1}", "case": case,
                      "batch": batch, "round": rnd + 1}
            with common.measured_round(record, args.threads):
                result = spawn({"model": models[case], "batch": batch, "prompts": prompts,
                                "decode_tokens": args.decode_tokens}, args.threads)
            record.update(result)
            rounds.append(record)
            shown = (f"{statistics.median(result['step_s']) * 1e3:.2f} ms"
                     if result.get("step_s") else result)
            print(f"[plan-vs-measured] {record['name']}: {shown}", file=sys.stderr, flush=True)
    from llmctl.perf.plan import CPU_PROBED

    report["model"] = {"peaks": peaks.to_dict(), "context": context,
                       "efficiency": CPU_PROBED.to_dict()}
    report["rounds"] = rounds
    report["summary"] = summarize(rounds, configs, peaks, batches, context)
    common.finish_run(report, rounds)
    common.write_report(out_dir, "plan-vs-measured-smollm2", report, render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
