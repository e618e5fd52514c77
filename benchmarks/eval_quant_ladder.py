"""Quantize SmolLM2 with several recipes and evaluate each against the original.

Runs the same commands a CI job would (``llmctl quantize``, then ``llmctl eval`` with a
baseline and gates), writes one eval report per recipe and a comparison:

    python benchmarks/eval_quant_ladder.py --out results --work /tmp/ladder

Results: results/eval-smollm2-<recipe>.{json,md}, results/eval-smollm2-compare.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import common

from llmctl.utils.atomic import write_text

RECIPES = ("w8a16-gptq", "w4a16-rtn", "w4a16-gptq", "w4a16-awq")
BASELINE = "results/reference/smollm2-135m.json"


def run(cmd: list[str], log: list[dict]) -> int:
    start = time.perf_counter()
    print("$", " ".join(cmd), flush=True)
    code = subprocess.run(cmd, check=False).returncode
    log.append({"command": " ".join(cmd), "exit_code": code,
                "seconds": round(time.perf_counter() - start, 1), "load": list(os.getloadavg())})
    return code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/llmctl-ladder"))
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--recipes", nargs="*", default=list(RECIPES))
    parser.add_argument("--allow-dirty", action="store_true",
                        help="write results/ from an uncommitted tree anyway")
    args = parser.parse_args()
    common.refuse_dirty(common.tree_state(), args.allow_dirty, args.out)
    llmctl = [sys.executable, "-m", "llmctl"]
    log: list[dict] = []
    reports = []
    for recipe in args.recipes:
        ckpt = args.work / f"smollm2-{recipe}"
        quantize = llmctl + ["quantize", "smollm2-135m", "--recipe", f"recipes/{recipe}.yaml",
                              "--samples", str(args.samples), "--seq-len", str(args.seq_len),
                              "--threads", str(args.threads), "--overwrite", "-o", str(ckpt)]
        if not (ckpt / "config.json").is_file() and run(quantize, log):
            continue
        report = args.out / f"eval-smollm2-{recipe}.json"
        run(llmctl + ["eval", str(ckpt), "--reference", "smollm2-135m",
                      "--data", "builtin:pydoc-heldout", "--tasks", "builtin",
                      "--threads", str(args.threads), "--baseline", BASELINE,
                      "--gate-file", "results/reference/gates-w4a16.yaml",
                      "--junit", str(args.work / f"{recipe}-junit.xml"), "-o", str(report)], log)
        if report.is_file():
            reports.append(str(report))
    if len(reports) >= 2:
        out = subprocess.run(llmctl + ["eval", "compare", *reports, "--json"], capture_output=True,
                             text=True, check=True).stdout
        write_text(args.out / "eval-smollm2-compare.json", out)
        from llmctl.eval.compare import markdown

        write_text(
            args.out / "eval-smollm2-compare.md",
            "# SmolLM2-135M: quantization recipes against the original\n\n"
            + markdown(json.loads(out)) + "\n\nCommands (exit code 1 = a gate failed):\n\n"
            + "\n".join(f"- `{e['command']}` -> {e['exit_code']} ({e['seconds']} s, load "
                        f"{[round(x, 1) for x in e['load']]})" for e in log) + "\n")


if __name__ == "__main__":
    main()
