"""llmctl vs llm-compressor 0.14: GPTQ and AWQ, W4 group 64, same model, same calibration
tokens, time and held-out perplexity, all measured in one run.

Targets (issue #3): llmctl's GPTQ at least 2x faster than llm-compressor's with held-out
perplexity no worse; the same for AWQ. llm-compressor runs in its own venv (it pins
transformers <= 5.17 and compressed-tensors 0.19):

    python3 -m venv /work/venvs/llmcompressor
    /work/venvs/llmcompressor/bin/pip install torch==2.13.0
    /work/venvs/llmcompressor/bin/pip install 'llmcompressor==0.14.*'
    .venv/bin/python benchmarks/quant_vs_llmcompressor.py [--samples 32 --seq-len 256 --rounds 2]

Both tools get the same token windows: llmctl draws them (seeded) and they are handed to
llm-compressor as a tokenized dataset; the SHA-256 of the windows is checked. Both
calibrate in float32 (llm-compressor loads the model in float32; llmctl gets
``--calib-dtype float32``). The tools alternate (llmctl, llm-compressor, llmctl, ...) for
``--rounds`` rounds, each run's wall time and the load average before it are recorded,
and the speedup is reported per round and as the median. The llmctl commit is recorded;
a tree with uncommitted changes is refused (the results must name the code they measured).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import measured_round
from benchmarks.quant_common import (
    ROOT,
    command_line,
    dir_sha256,
    heldout_perplexity,
    llmctl_quantize,
    run_child,
    thread_env,
    write_recipe,
    write_results,
)

LLMCOMPRESSOR_PY = Path("/work/venvs/llmcompressor/bin/python")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", default="gptq,awq")
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calib-dtype", default="float32")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="run on uncommitted changes (a trial; the results say -dirty)")
    parser.add_argument("--python", default=str(LLMCOMPRESSOR_PY))
    parser.add_argument("--name", default="quant-vs-llmcompressor-w4g64-smollm2")
    args = parser.parse_args()

    import statistics

    import numpy as np

    from llmctl.models.loading import load_tokenizer
    from llmctl.models.resolve import resolve_model
    from llmctl.quant.calibration import CalibrationSpec, build_calibration
    from llmctl.report import run_metadata

    metadata = run_metadata(command="benchmarks/quant_vs_llmcompressor.py")
    commit = metadata["llmctl_commit"] or "unknown"
    if (commit.endswith("-dirty") or commit == "unknown") and not args.allow_dirty:
        raise SystemExit(f"llmctl commit {commit}: commit your changes first so the "
                         "results name the code they measured (or pass --allow-dirty)")
    model_dir = resolve_model(args.model).path
    work = Path(tempfile.mkdtemp(prefix="quant-vs-llmc-"))
    calib = build_calibration(load_tokenizer(model_dir),
                              CalibrationSpec(samples=args.samples, seq_len=args.seq_len))
    windows = work / "windows.json"
    windows.write_text(json.dumps(calib.ids.tolist()))
    rows = {}
    for method in args.methods.split(","):
        recipe = write_recipe(work, method, 4, args.group_size)
        rounds = []
        for r in range(args.rounds):
            ours = work / f"llmctl-{method}-{r}"
            theirs = work / f"llmcompressor-{method}-{r}"

            def run_llmctl(ours=ours, r=r, recipe=recipe, method=method):
                run = llmctl_quantize(str(model_dir), recipe, ours, samples=args.samples,
                                      seq_len=args.seq_len, threads=args.threads,
                                      log=work / f"llmctl-{method}-{r}.log",
                                      calib_dtype=args.calib_dtype)
                if run["report"]["calibration"]["tokens_sha256"] != calib.sha256:
                    raise SystemExit("llmctl drew different calibration windows than the "
                                     "benchmark")
                run["output_sha256"] = dir_sha256(ours)
                return run

            def run_llmcompressor(theirs=theirs, r=r, method=method):
                cmd = [args.python, str(ROOT / "benchmarks" / "quant_llmcompressor_child.py"),
                       "--model", str(model_dir), "--windows", str(windows), "--method",
                       method, "--group-size", str(args.group_size), "--out", str(theirs)]
                other = run_child(cmd, thread_env(args.threads),
                                  work / f"llmcompressor-{method}-{r}.log")
                if other["exit_code"] != 0:
                    raise SystemExit(f"llm-compressor {method} failed, see {other['log']}")
                other["tool"] = json.loads((theirs / "llmcompressor-run.json").read_text())
                other["output_sha256"] = dir_sha256(theirs)
                return other

            # The first tool alternates between rounds (llmctl first in even rounds), so
            # neither always runs on a cooler or warmer machine.
            order = ("llmctl", "llmcompressor") if r % 2 == 0 else ("llmcompressor", "llmctl")
            runners = {"llmctl": run_llmctl, "llmcompressor": run_llmcompressor}
            done = {}
            for tool in order:
                record: dict = {}
                with measured_round(record, args.threads):
                    done[tool] = runners[tool]()
                done[tool]["foreign_cpu_cores"] = record["foreign_cpu_cores"]
                done[tool]["contended"] = record["contended"]
            run, other = done["llmctl"], done["llmcompressor"]
            speedup = other["wall_seconds"] / run["wall_seconds"]
            rounds.append({"round": r, "order": list(order), "llmctl": run,
                           "llmcompressor": other, "speedup": speedup})
            print(f"[{method} round {r}] {' then '.join(order)}: llmctl "
                  f"{run['wall_seconds']:.1f} s (other procs {run['foreign_cpu_cores']}), "
                  f"llm-compressor {other['wall_seconds']:.1f} s (other procs "
                  f"{other['foreign_cpu_cores']}): {speedup:.2f}x", flush=True)
        speedups = [x["speedup"] for x in rounds]
        rows[method] = {"rounds": rounds, "llmctl_recipe": recipe.read_text(),
                        "speedup_median": statistics.median(speedups),
                        "speedup_min": min(speedups), "speedup_max": max(speedups),
                        "llmctl_outputs_identical": len({x["llmctl"]["output_sha256"]
                                                         for x in rounds}) == 1}
    print("evaluating held-out perplexity (round 0 outputs) ...", flush=True)
    ppl = {"float": heldout_perplexity(model_dir, args.eval_windows)}
    for method, row in rows.items():
        row["ppl_llmctl"] = ppl[f"llmctl-{method}"] = heldout_perplexity(
            work / f"llmctl-{method}-0", args.eval_windows)
        row["ppl_llmcompressor"] = ppl[f"llmcompressor-{method}"] = heldout_perplexity(
            work / f"llmcompressor-{method}-0", args.eval_windows)
        row["targets"] = {"at_least_2x_faster": row["speedup_median"] >= 2.0,
                          "ppl_no_worse": row["ppl_llmctl"] <= row["ppl_llmcompressor"]}
    data = {"benchmark": "quant_vs_llmcompressor", "command": command_line(),
            "model": str(model_dir), "group_size": args.group_size, "samples": args.samples,
            "seq_len": args.seq_len, "threads": args.threads, "rounds": args.rounds,
            "calib_dtype": args.calib_dtype, "calibration_tokens_sha256": calib.sha256,
            "eval": {"source": "builtin:pydoc-heldout", "windows": args.eval_windows,
                     "seq_len": 512},
            "perplexity": ppl, "methods": rows,
            "windows_sha256": hashlib.sha256(np.asarray(calib.ids).tobytes()).hexdigest(),
            "metadata": metadata}
    rounds_table = "\n".join(
        f"| {m} | {x['round']} | {x['order'][0]} | {x['llmctl']['wall_seconds']:.1f} | "
        f"{x['llmcompressor']['wall_seconds']:.1f} | {x['speedup']:.2f}x | "
        f"{'/'.join(f'{v:.1f}' for v in x['llmctl']['load_before'])} ; "
        f"{'/'.join(f'{v:.1f}' for v in x['llmcompressor']['load_before'])} | "
        f"{x['llmctl']['foreign_cpu_cores']} ; {x['llmcompressor']['foreign_cpu_cores']} |"
        for m, r in rows.items() for x in r["rounds"])
    table = "\n".join(
        f"| {m} | {r['speedup_median']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f}) | "
        f"{r['ppl_llmctl']:.3f} | {r['ppl_llmcompressor']:.3f} |" for m, r in rows.items())
    md = f"""# llmctl vs llm-compressor: W4 group {args.group_size} on {args.model}

Command: `{data['command']}`

Same model, group size, scheme (int4 symmetric, `lm_head` kept) and calibration windows
({args.samples} x {args.seq_len} tokens of builtin:pydoc-calib, SHA-256
`{calib.sha256[:16]}...`, calibration in {args.calib_dtype}); GPTQ with static act-order on
both sides, AWQ with a 20-point grid. Held-out perplexity on {args.eval_windows} x 512 tokens
of builtin:pydoc-heldout, both checkpoints loaded by transformers (float model:
{ppl['float']:.3f}). Threads: {args.threads}. Commit: {commit}.

| method | speedup, median (range) over {args.rounds} rounds | llmctl ppl | llm-compressor ppl |
|---|---|---|---|
{table}

Every round (the tool that ran first alternates; both at OpenMP's default wait policy,
{args.threads} threads each):

| method | round | first | llmctl s | llm-compressor s | speedup | load avg before (llmctl ; llm-compressor) | other procs, cores (llmctl ; llm-compressor) |
|---|---|---|---|---|---|---|---|
{rounds_table}

Wall times are whole child processes (imports, model load, calibration, writing).
"Other procs": CPU used outside this benchmark's process tree during the run
(benchmarks/common.py); above 0.25 cores a run counts as contended.
"""
    json_path, md_path = write_results(args.name, data, md)
    print(md)
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
