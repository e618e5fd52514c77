"""GPTQ W4 (group 64) on SmolLM2-135M with 128 x 512 calibration tokens: wall time and peak
RSS, with round-to-nearest measured in the same run as the baseline.

Targets (issue #3): GPTQ under 5 minutes on this 2-core machine, peak RSS under twice
the float model's size. Each method runs as its own ``llmctl quantize`` child process so
its peak RSS is its own (``wait4``); held-out perplexity is measured afterwards.

    .venv/bin/python benchmarks/quant_bench.py [--samples 128 --seq-len 512 --threads 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quant_common import (
    command_line,
    dir_bytes,
    heldout_perplexity,
    llmctl_quantize,
    write_recipe,
    write_results,
)

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", default="gptq,rtn")
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--name", default="quant-bench-w4g64-smollm2")
    args = parser.parse_args()

    from llmctl.models.resolve import resolve_model
    from llmctl.report import run_metadata

    model_dir = resolve_model(args.model).path
    float_bytes = dir_bytes(model_dir)
    work = Path(tempfile.mkdtemp(prefix="quant-bench-"))
    runs = {}
    for method in args.methods.split(","):
        recipe = write_recipe(work, method, 4, args.group_size)
        out = work / f"out-{method}"
        print(f"[{method}] quantizing ...", flush=True)
        runs[method] = llmctl_quantize(str(model_dir), recipe, out, samples=args.samples,
                                       seq_len=args.seq_len, threads=args.threads,
                                       log=work / f"{method}.log")
        runs[method]["recipe"] = recipe.read_text()
        runs[method]["output_bytes"] = dir_bytes(out)
        print(f"[{method}] {runs[method]['wall_seconds']:.1f} s, "
              f"peak RSS {runs[method]['peak_rss_bytes'] / MIB:.0f} MiB", flush=True)
    print("evaluating held-out perplexity ...", flush=True)
    ppl = {"float": heldout_perplexity(model_dir, args.eval_windows)}
    for method in runs:
        ppl[method] = heldout_perplexity(work / f"out-{method}", args.eval_windows)
    gptq = runs.get("gptq")
    targets = {}
    if gptq:
        targets = {"gptq_under_300_s": gptq["wall_seconds"] < 300,
                   "gptq_rss_under_2x_float": gptq["peak_rss_bytes"] < 2 * float_bytes}
    data = {
        "benchmark": "quant_bench", "command": command_line(), "model": str(model_dir),
        "float_model_bytes": float_bytes, "samples": args.samples, "seq_len": args.seq_len,
        "group_size": args.group_size, "threads": args.threads,
        "eval": {"source": "builtin:pydoc-heldout", "windows": args.eval_windows, "seq_len": 512},
        "perplexity": ppl, "runs": runs, "targets": targets,
        "ratios": ({"gptq_over_rtn_time": gptq["wall_seconds"] / runs["rtn"]["wall_seconds"]}
                   if gptq and "rtn" in runs else {}),
        "metadata": run_metadata(command="benchmarks/quant_bench.py"),
    }
    rows = "\n".join(
        f"| {m} | {r['wall_seconds']:.1f} | {r['report']['timings']['quantize_seconds']:.1f} | "
        f"{r['peak_rss_bytes'] / MIB:.0f} | {r['peak_rss_bytes'] / float_bytes:.2f}x | "
        f"{r['output_bytes'] / MIB:.1f} | {ppl[m]:.3f} | "
        f"{'/'.join(f'{x:.1f}' for x in r['load_before'])} -> {'/'.join(f'{x:.1f}' for x in r['load_after'])} |"
        for m, r in runs.items())
    md = f"""# llmctl quantize: W4 group {args.group_size} on {args.model}

Command: `{data['command']}`

Calibration: {args.samples} x {args.seq_len} tokens of builtin:pydoc-calib; held-out
perplexity on {args.eval_windows} x 512 tokens of builtin:pydoc-heldout (float model:
{ppl['float']:.3f}). Float model: {float_bytes / MIB:.0f} MiB. Threads: {args.threads}.
Commit: {data['metadata']['llmctl_commit']}. Each method runs as its own child process.

| method | wall s | quantize s | peak RSS MiB | RSS / float size | output MiB | held-out ppl | load avg before -> after |
|---|---|---|---|---|---|---|---|
{rows}

Targets: {', '.join(f'{k}: {"yes" if v else "NO"}' for k, v in targets.items()) or 'n/a'}.
The machine is shared with other jobs: see the load averages; times scale with them.
"""
    json_path, md_path = write_results(args.name, data, md)
    print(md)
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
