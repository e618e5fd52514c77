"""What an 8-bit KV cache buys when memory is the limit: output tokens/s of SmolLM2 with
``--kv-cache-dtype int8`` and ``fp8`` against its bfloat16 cache at the same
``--kv-cache-memory``, on many long contexts, alternating in one run; plus the quality
cost, from ``llmctl eval --backend serve`` (mean KLD and same top-1 against the bf16
cache).

    python benchmarks/kv_cache_dtype.py                 # 3 rounds: bf16 int8 fp8, int8 fp8 bf16, ...
    python benchmarks/kv_cache_dtype.py --num-prompts 64 --input-len 128 --output-len 512 \
        --label decode                                  # decode-heavy: short prompts, long outputs
    python benchmarks/kv_cache_dtype.py --rounds 1 --num-prompts 6 --input-len 96 \\
        --output-len 8 --kv-memory 8MiB --max-model-len 256 --eval-windows 1 \\
        --out-dir /tmp/kv-smoke --allow-dirty           # a smoke run (< 1 min)

Model and limits: SmolLM2-135M in bf16, max_model_len 2048, max_num_seqs 64, 2048
batched tokens, chunked prefill and prefix caching on, and a KV budget (default 256 MiB)
that holds ~11.6k tokens of bf16 K/V (22.5 KiB a token) and ~21.9k of int8 with its
scales (12 KiB) and ~23.3k of fp8 (11.25 KiB, static scales): with 64 prompts of 1024
tokens + 128 out (1152 each), bf16 runs ~10 sequences at once and queues or preempts the
rest, int8 ~19, fp8 ~20. Everything else is equal. fp8's scales are calibrated when
each batch process starts (SmolLM2's checkpoint has no ``kv_cache_scheme``), which the
throughput excludes with the model load.

Each side is one ``llmctl batch`` process (``batch_vs_serve.py``'s runner: the bench's
random prompts in an OpenAI batch file, EOS ignored, greedy, pinned to every allowed CPU,
one torch thread per CPU); its throughput is the batch summary's ``output_throughput``
(completion tokens / seconds from the first line in to the last line out; model load
excluded, no warm-up). Each side's blocks and tokens are the engine's own plan for that
budget (``llmctl.serve.model.kv_cache.plan_kv_cache``, scales counted).
Rounds rotate the order (round r starts with side r of ``--sides``); each 8-bit side's
ratio to bf16 is taken within a round and the summary is the median over rounds. Every
round records the load before/after and the CPU other processes used (``common.py``).

Quality: for each 8-bit side one ``llmctl eval MODEL --reference MODEL --backend serve
--dtype bfloat16 --kv-cache-dtype SIDE`` on builtin:pydoc-heldout (``--eval-windows``
windows of 512): candidate and reference run in the same engine and differ in the cache
alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import batch_vs_serve as bvs
import common
import serve_vs_vllm as svv

fmt = common.fmt  # a table cell: '?' when not measured

SIDES = ("bfloat16", "int8", "fp8")
BASE = "bfloat16"


def kv_plan(model: str, side: str, kv_memory: str, lim: svv.Limits) -> dict:
    """The blocks the engine plans for this cache dtype and budget (what it logs)."""
    import torch

    from llmctl.serve.layers.kv_quant import kv_format
    from llmctl.serve.model.decoder import ModelSpec
    from llmctl.serve.model.kv_cache import plan_kv_cache

    spec = ModelSpec.from_dir(Path(model))
    fmt = kv_format(side, torch.bfloat16)
    plan = plan_kv_cache(num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                         head_dim=spec.head_dim, itemsize=fmt.storage.itemsize, block_size=16,
                         budget=kv_memory, max_num_seqs=lim.max_num_seqs,
                         max_model_len=lim.max_model_len, scale_bytes=fmt.scale_bytes,
                         dtype=fmt.describe())
    return {"blocks": plan.num_blocks, "tokens": plan.num_tokens,
            "bytes_per_block": plan.bytes_per_block}


def run_side(rnd: int, side: str, model: str, lim: svv.Limits, w: bvs.Workload, src: Path,
             kv_memory: str, log_dir: Path) -> dict:
    # the budget given after limit_flags' own --kv-cache-memory: the last value counts
    extra = ("--kv-cache-dtype", side, "--kv-cache-memory", kv_memory)
    record = bvs.run_batch_side(rnd, model, lim, w, src, log_dir, side=side, extra=extra)
    record["kv_cache"] = kv_plan(model, side, kv_memory, lim)
    return record


def run_eval(model: str, side: str, windows: int, lim: svv.Limits, log_dir: Path) -> dict:
    cmd = bvs.pinned([sys.executable, "-m", "llmctl", "eval", model, "--reference", model,
                      "--backend", "serve", "--dtype", "bfloat16", "--kv-cache-dtype", side,
                      "--max-windows", str(windows), "--threads", str(len(lim.cpus)),
                      "--cache-dir", str(log_dir / "eval-cache"), "--json"], lim)
    record: dict = {"command": cmd}
    start = time.perf_counter()
    with common.measured_round(record, len(lim.cpus)), \
            open(log_dir / f"eval-{side}.log", "w") as log:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, check=False)
    record["wall_s"] = round(time.perf_counter() - start, 1)
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        record["error"] = f"llmctl eval failed (exit {proc.returncode}): see eval-{side}.log"
        return record
    m = report["metrics"]
    record["result"] = {k: m.get(k) for k in ("mean_kld", "mean_kld_se", "p99_kld", "max_kld",
                                              "same_top_p", "same_top_p_se", "ppl")}
    record["result"]["reference_ppl"] = report["reference_metrics"].get("ppl")
    record["result"]["tokens"] = report["counts"].get("same_top_p")
    record["result"]["kv_cache"] = report["metadata"]["candidate"].get("kv_cache")
    return record


def render_markdown(report: dict) -> str:
    cfg, res = report["config"], report["results"]
    w, lim = cfg["workload"], cfg["limits"]
    sides = cfg.get("sides", ["bfloat16", "int8"])
    quantized = [s for s in sides if s != BASE]
    lines = common.header_markdown(report, f"KV cache {' / '.join(quantized)} vs bfloat16 "
                                           "(memory-limited)")
    lines += [(f"SmolLM2 `{cfg['model']}` {lim['dtype']} weights, KV budget {cfg['kv_memory']} "
               f"for both, max_num_seqs {lim['max_num_seqs']}, max_model_len "
               f"{lim['max_model_len']}, CPUs {lim['cpus']}. {w['num_prompts']} random "
               f"prompts of {w['input_len']} tokens, {w['output_len']} out, EOS ignored, "
               f"greedy, seed {w['seed']}; each side one `llmctl batch` run."),
              f"Logs and outputs: `{cfg['log_dir']}`.", "",
              ("| round | KV dtype | KV blocks (tokens) | output tok/s | measured s | "
               "load before / after | other procs (cores) |"), "|" + "---|" * 7]
    for r in res["runs"]:
        if "error" in r:
            lines.append(f"| {r['round']} | {r['side']} | error: {r['error'][:200]} |"
                         + " |" * 4)
            continue
        x, kv = r["result"], r.get("kv_cache") or {}
        lines.append(f"| {r['round']} | {r['side']} | {kv.get('blocks', '?')} "
                     f"({kv.get('tokens', '?')}) | {fmt(x['output_throughput'], '.1f')} | "
                     f"{fmt(x['duration'], '.1f')} | {r['load_before'][0]} / "
                     f"{r['load_after'][0]} | {r['foreign_cpu_cores']} |")
    lines += [""] + common.ab_markdown(res["per_round"], res["summary"],
                                       [(side, f"{side} KV") for side in sides],
                                       [(f"{q}_over_bf16", f"{q} / bf16") for q in quantized])
    for side, ev in (res.get("eval") or {}).items():
        lines += ["", f"## Quality: {side} KV against bf16 KV (`llmctl eval --backend serve`)",
                  ""]
        if "error" in ev:
            lines.append(f"error: {ev['error']}")
            continue
        e = ev["result"]
        lines.append(
            f"Candidate cache: {e.get('kv_cache', side)}. {e['tokens']} tokens of "
            f"builtin:pydoc-heldout: mean KLD "
            f"{fmt(e['mean_kld'], '.5f')} (se {fmt(e['mean_kld_se'], '.5f')}), p99 "
            f"{fmt(e['p99_kld'], '.4f')}, max {fmt(e['max_kld'], '.3f')}; same top-1 "
            f"{fmt(e['same_top_p'], '.4f')}; perplexity {fmt(e['ppl'], '.3f')} "
            f"(bf16 KV {fmt(e['reference_ppl'], '.3f')}). Load before/after "
            f"{ev['load_before'][0]} / {ev['load_after'][0]}.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_workload_arguments(ap, num_prompts=64, input_len=1024, output_len=128)
    ap.add_argument("--kv-memory", default="256MiB", help="KV budget of both sides")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--sides", default=",".join(SIDES),
                    help="KV cache dtypes, comma-separated, bfloat16 (the baseline) included")
    ap.add_argument("--eval-windows", type=int, default=16,
                    help="windows of 512 tokens for the KLD (0: no eval)")
    common.add_run_arguments(ap)
    args = ap.parse_args(argv)
    sides = tuple(args.sides.split(","))
    if BASE not in sides or len(sides) < 2 or not set(sides) <= set(SIDES):
        ap.error(f"--sides: {BASE} and at least one of {SIDES[1:]}")
    quantized = [s for s in sides if s != BASE]
    from llmctl.models.resolve import resolve_model

    model = str(resolve_model(args.model).path)
    cpus = common.cpu_list(args.cpus)
    lim = svv.Limits("bfloat16", args.max_model_len, 64, 2048, 2, cpus)  # kv: --kv-memory
    w = bvs.Workload(args.num_prompts, args.input_len, args.output_len, args.seed)
    log_dir = Path(f"/tmp/llmctl-kv-cache-dtype/{args.label}-{time.strftime('%Y%m%d-%H%M%S')}")
    log_dir.mkdir(parents=True, exist_ok=True)
    src = log_dir / "input.jsonl"
    fingerprint = bvs.build_input(model, w, src)
    report = common.start_run("kv-cache-dtype", {
        "model": args.model, "model_path": model, "limits": asdict(lim), "workload": asdict(w),
        "kv_memory": args.kv_memory, "rounds": args.rounds, "fingerprint": fingerprint,
        "eval_windows": args.eval_windows, "log_dir": str(log_dir), "sides": list(sides),
        "order": "round r starts with side r of sides, rotating"},
        allow_dirty=args.allow_dirty, threads=len(cpus), out=args.out_dir)
    runs = []
    for rnd in range(1, args.rounds + 1):
        for side in common.rotation(sides, rnd):
            print(f"[kv-cache-dtype] round {rnd} {side} ...", file=sys.stderr, flush=True)
            rec = run_side(rnd, side, model, lim, w, src, args.kv_memory, log_dir)
            runs.append(rec)
            print("[kv-cache-dtype]   " + (rec.get("error") or
                                           f"{rec['result']['output_throughput']:.1f} tok/s"),
                  file=sys.stderr, flush=True)
    per_round, summary = common.against_base(runs, args.rounds, quantized, BASE,
                                             "{}_over_bf16")
    report["results"] = {"runs": runs, "per_round": per_round, "summary": summary}
    if args.eval_windows:
        report["results"]["eval"] = {}
        for q in quantized:
            print(f"[kv-cache-dtype] eval {q} ...", file=sys.stderr, flush=True)
            report["results"]["eval"][q] = run_eval(model, q, args.eval_windows, lim, log_dir)
    common.finish_run(report, runs)
    markdown = render_markdown(report)
    common.write_report(Path(args.out_dir), f"kv-cache-dtype-{args.label}", report, markdown)
    print(markdown)
    bad = [r["name"] for r in runs if "error" in r]
    bad += [f"eval {q}" for q, ev in report["results"].get("eval", {}).items() if "error" in ev]
    if bad:
        print(f"[kv-cache-dtype] runs that failed: {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
