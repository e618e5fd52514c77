"""Shared plumbing for the quantization benchmarks: child runs with wall time and peak
RSS, recipes written on the fly, held-out perplexity, and the results files."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Thread pools sized as in every benchmark (benchmarks/common.py); OpenMP's wait policy is
# left at its default for both tools, as users run them (it was PASSIVE here before, unlike
# every other benchmark, with no measurement of whether that favoured one tool).
from benchmarks.common import thread_env

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"

RECIPE = """quant_stage:
  quant_modifiers:
    {modifier}:
      ignore: [lm_head]
{extra}      config_groups:
        group_0:
          targets: [Linear]
          weights: {{num_bits: {bits}, type: int, strategy: group, group_size: {group}, symmetric: true}}
"""
MODIFIERS = {"rtn": ("QuantizationModifier", ""), "gptq": ("GPTQModifier", "      actorder: static\n"),
             "awq": ("AWQModifier", "      n_grid: 20\n")}


def write_recipe(directory: Path, method: str, bits: int = 4, group: int = 64) -> Path:
    modifier, extra = MODIFIERS[method]
    path = directory / f"w{bits}g{group}-{method}.yaml"
    path.write_text(RECIPE.format(modifier=modifier, extra=extra, bits=bits, group=group))
    return path


def run_child(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, Any]:
    """Run ``cmd``; wall seconds, peak RSS of the child (wait4) and load averages."""
    load_before = os.getloadavg()
    start = time.perf_counter()
    with open(log, "w") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    return {"command": shlex.join(cmd), "exit_code": code, "wall_seconds": seconds,
            "peak_rss_bytes": usage.ru_maxrss * 1024, "load_before": list(load_before),
            "load_after": list(os.getloadavg()), "log": str(log)}


def llmctl_quantize(model: str, recipe: Path, out: Path, *, samples: int, seq_len: int,
                    threads: int, log: Path, seed: int = 0,
                    calibration: str = "builtin:pydoc-calib",
                    calib_dtype: str | None = None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "llmctl", "quantize", model, "--recipe", str(recipe), "-o", str(out),
           "--samples", str(samples), "--seq-len", str(seq_len), "--seed", str(seed),
           "--calibration", calibration, "--threads", str(threads), "--overwrite", "--json"]
    if calib_dtype:
        cmd += ["--calib-dtype", calib_dtype]
    result = run_child(cmd, thread_env(threads), log)
    if result["exit_code"] != 0:
        raise SystemExit(f"llmctl quantize failed, see {log}")
    report = json.loads((out / "llmctl-quant.json").read_text())
    result["report"] = {k: report[k] for k in ("method", "format", "calibration", "sizes",
                                               "timings", "peak_rss_bytes", "warnings")}
    return result


def heldout_perplexity(directory: Path, windows: int, seq_len: int = 512) -> float:
    """Held-out perplexity of a checkpoint as transformers loads it (float32)."""
    import torch

    from llmctl.models.loading import load_tokenizer
    from llmctl.quant import quality

    torch.manual_seed(0)
    tokenizer = load_tokenizer(directory)
    ids = quality.heldout_windows(tokenizer, seq_len=seq_len, max_windows=windows)
    return quality.checkpoint_perplexity(directory, ids)


def dir_sha256(directory: Path) -> str:
    """One digest over the checkpoint's safetensors files (are two runs' outputs equal?)."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(Path(directory).glob("*.safetensors")):
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))


def write_results(name: str, data: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    RESULTS.mkdir(exist_ok=True)
    json_path = RESULTS / f"{name}.json"
    md_path = RESULTS / f"{name}.md"
    json_path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    md_path.write_text(markdown)
    return json_path, md_path


def command_line() -> str:
    return shlex.join([Path(sys.executable).name, *sys.argv])
