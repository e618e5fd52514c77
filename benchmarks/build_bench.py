"""Engine directories against eager transformers and the llmctl engine, in one run.

    python benchmarks/build_bench.py                         # SmolLM2, every backend
    python benchmarks/build_bench.py --output-len 32 --backends hf,onnx-int4

Backends (each measured in its own subprocess, one after the other, same prompts):

- ``hf``: transformers ``generate`` (float32, eager) -- the baseline of every ratio;
- ``llmctl``: llmctl's engine (``llmctl.serve.engine.llm.LLM``, float32), if present;
- ``onnx-fp32`` / ``onnx-int4``: ``llmctl build-engine --target onnx`` engines run by
  ONNX Runtime (int4: MatMulNBits, block 32, accuracy level 4 = int8 activations);
- ``torch-compile``: the AOTInductor package (float32).

Metrics (definitions as in vLLM's benchmarks):

- batch 1 decode tokens/s = ``(N - 1) / (t(N) - t(1))``: the time of an N-token
  generation minus that of a 1-token one (prefill + first token), per later token;
- batch 16 output throughput = ``16 N / t(N)`` (prefill included) and decode throughput
  ``16 (N - 1) / (t(N) - t(1))``, 16 prompts of equal length (no padding anywhere).

EOS is ignored so every backend produces N tokens; greedy tokens of batch 1 are
compared with transformers' (``agree`` = leading tokens equal). Threads are set
deliberately (torch, OpenMP and ONNX Runtime pools; OMP_WAIT_POLICY=PASSIVE and ORT
spinning off, because busy-waiting pools collapse on a contended machine). Every
backend's run records the load average before and after and the CPU other processes
used meanwhile; a run is contended when that passes a quarter of a core (``common.py``,
which also refuses a dirty tree unless ``--allow-dirty``).

Writes ``results/build-bench-<label>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common

# backend -> (engine target, precision) for the engine-directory backends
ENGINES = {"onnx-fp32": ("onnx", "fp32"), "onnx-int4": ("onnx", "int4"),
           "torch-compile": ("torch-compile", "fp32")}
BACKENDS = ("hf", "llmctl", *ENGINES)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# --- worker side -----------------------------------------------------------------------------
def make_generate(backend: str, args) -> tuple:
    """(generate(prompts, n) -> list[list[int]], description) for one backend."""
    import torch

    torch.set_num_threads(args.threads)
    if backend == "hf":
        from llmctl.models.loading import load_model
        from llmctl.models.resolve import resolve_model

        model = load_model(resolve_model(args.model).path, "float32")

        def generate(prompts, n):
            ids = torch.tensor(prompts)
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=n, min_new_tokens=n, pad_token_id=2)
            return out[:, ids.shape[1]:].tolist()

        return generate, {"runtime": f"transformers {__import__('transformers').__version__}"}
    if backend == "llmctl":
        from llmctl.serve.core.sampling_params import SamplingParams
        from llmctl.serve.engine.llm import LLM

        llm = LLM(args.model, dtype="float32", num_threads=args.threads)

        def generate(prompts, n):
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

        return generate, {"runtime": "llmctl engine (float32)"}
    from llmctl.engines.engine_dir import open_engine

    engine = open_engine(Path(args.work) / f"{args.label}-{backend}", threads=args.threads,
                         spin=False)

    def generate(prompts, n):
        return engine.generate(prompts, max_tokens=n, ignore_eos=True)

    return generate, engine.describe()


def timed(fn, *a) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn(*a)
    return time.perf_counter() - start, out


def worker(backend: str, args) -> dict:
    prompts = json.loads(Path(args.prompts).read_text())
    n, b = args.output_len, args.batch
    load_before = load()
    seconds, (generate, info) = timed(make_generate, backend, args)
    generate(prompts[:1], 4)  # warm-up
    b1 = []
    tokens = None
    for _ in range(args.repeats):
        t1, _ = timed(generate, prompts[:1], 1)
        tn, out = timed(generate, prompts[:1], n)
        tokens = out[0]
        b1.append((n - 1) / max(tn - t1, 1e-9))
    t1, _ = timed(generate, prompts[:b], 1)
    tn, outs = timed(generate, prompts[:b], n)
    assert all(len(o) == n for o in outs), [len(o) for o in outs]
    return {"backend": backend, "info": info, "load_seconds": round(seconds, 2),
            "batch1_decode_tok_s": round(statistics.median(b1), 2),
            "batch1_decode_tok_s_runs": [round(x, 2) for x in b1],
            "batch1_tokens": tokens,
            f"batch{b}_output_tok_s": round(b * n / tn, 2),
            f"batch{b}_decode_tok_s": round(b * (n - 1) / max(tn - t1, 1e-9), 2),
            f"batch{b}_seconds": round(tn, 2),
            "load_before": load_before, "load_after": load()}


# --- driver side -----------------------------------------------------------------------------
def ensure_engines(args, backends: list[str]) -> dict:
    builds = {}
    for backend in backends:
        if backend not in ENGINES:
            continue
        target, precision = ENGINES[backend]
        out = Path(args.work) / f"{args.label}-{backend}"
        record = Path(f"{out}.build.json")
        if not (out / "llmctl-engine.json").is_file():
            cmd = [sys.executable, "-m", "llmctl", "build-engine", args.model, "-t", target,
                   "--precision", precision, "-o", str(out), "--max-seq-len", "1024",
                   "--max-batch-size", str(max(args.batch, 16)), "--json"]
            print("building:", shlex.join(cmd), flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                                  env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            if proc.returncode != 0:
                raise SystemExit(f"build failed: {proc.stderr[-2000:]}")
            record.write_text(proc.stdout)
        manifest = json.loads((out / "llmctl-engine.json").read_text())
        builds[backend] = {"seconds": manifest["build"]["seconds"],
                           "machine_load": manifest["build"]["machine_load"],
                           "bytes": sum(f["size"] for f in manifest["files"].values()),
                           "tool": manifest["build"]["tool"], "command": manifest["build"]["command"]}
    return builds


def make_prompts(args) -> Path:
    from llmctl.data.sources import load_text_source, token_stream
    from llmctl.models.loading import load_tokenizer
    from llmctl.models.resolve import resolve_model

    tok = load_tokenizer(resolve_model(args.model).path)
    stream = token_stream(tok, load_text_source("builtin:pydoc-heldout"))
    stream = list(stream[: args.batch * args.input_len * 3])
    step = len(stream) // args.batch
    prompts = [stream[i * step: i * step + args.input_len] for i in range(args.batch)]
    path = Path(args.work) / f"prompts-{args.input_len}x{args.batch}.json"
    path.write_text(json.dumps(prompts))
    return path


def agree(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def report(args, results: list[dict], builds: dict, frame: dict) -> None:
    b = args.batch
    base = next((r for r in results if r["backend"] == "hf" and "error" not in r), None)
    ref_tokens = base["batch1_tokens"] if base else None
    rows = []
    for r in results:
        if "error" in r:
            rows.append(f"| {r['backend']} | failed: {r['error'][:80]} | | | | | |")
            continue
        ratio1 = r["batch1_decode_tok_s"] / base["batch1_decode_tok_s"] if base else None
        ratio16 = r[f"batch{b}_output_tok_s"] / base[f"batch{b}_output_tok_s"] if base else None
        r["ratio_batch1_vs_hf"] = round(ratio1, 2) if ratio1 else None
        r[f"ratio_batch{b}_vs_hf"] = round(ratio16, 2) if ratio16 else None
        r["agree_with_hf"] = agree(r["batch1_tokens"], ref_tokens) if ref_tokens else None
        rows.append(
            f"| {r['backend']} | {r['batch1_decode_tok_s']:.1f} | {ratio1:.2f}x | "
            f"{r[f'batch{b}_output_tok_s']:.1f} | {ratio16:.2f}x | "
            f"{r[f'batch{b}_decode_tok_s']:.1f} | {r['agree_with_hf']}/{args.output_len} | "
            f"{r['round']['load_before'][0]:.1f} / {r['round']['load_after'][0]:.1f} | "
            f"{r['round']['foreign_cpu_cores']} |")
    frame["builds"] = builds
    frame["results"] = results
    common.finish_run(frame, [r["round"] for r in results])
    build_rows = [f"| {k} | {v['seconds']:.0f} s | {v['bytes'] / 1e6:.0f} MB | "
                  f"{v['machine_load'][0] if v['machine_load'] else '?'} | {v['tool']} |"
                  for k, v in builds.items()]
    md = [*common.header_markdown(frame, f"build-engine benchmark: {args.model}"),
          (f"{args.threads} threads per backend, OMP_WAIT_POLICY=PASSIVE, ORT spinning "
           "off."), "",
          f"Prompts: {b} x {args.input_len} tokens of pydoc-heldout; {args.output_len} output "
          "tokens, greedy, EOS ignored. Ratios against eager transformers measured in the "
          "same run.", "",
          (f"| backend | batch 1 decode tok/s | vs hf | batch {b} output tok/s | vs hf | "
           f"batch {b} decode tok/s | greedy = hf | load 1-min before / after | other procs "
           "(cores) |"),
          "|---|---|---|---|---|---|---|---|---|", *rows, "",
          "Builds (from the engines' manifests):", "",
          "| engine | build time | size | load at build | tool |", "|---|---|---|---|---|",
          *build_rows, "",
          "Batch 1 decode = (N - 1) / (t(N) - t(1)); batch output throughput includes "
          "prefill. `greedy = hf`: leading greedy tokens equal to transformers' at batch 1 "
          "(fp32 backends differ only by float rounding; int4 is a different model).", "",
          ("`other procs`: cores' worth of CPU used by processes outside this benchmark "
           "during that backend's run; contended runs give lower bounds, and ratios between "
           "backends run minutes apart carry that noise too.")]
    common.write_report(Path(args.out_dir), f"build-bench-{args.label}", frame,
                        "\n".join(md) + "\n")
    print("\n".join(md))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--label", default="smollm2")
    parser.add_argument("--work", default="/tmp/llmctl-build-bench")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    common.add_run_arguments(parser)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--prompts", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return
    frame = common.start_run("build", {"model": args.model, "threads": args.threads,
                                       "input_len": args.input_len,
                                       "output_len": args.output_len, "batch": args.batch,
                                       "repeats": args.repeats, "backends": args.backends},
                             allow_dirty=args.allow_dirty, threads=args.threads,
                             out=args.out_dir)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    backends = [b for b in args.backends.split(",") if b]
    if "llmctl" in backends:
        import importlib.util

        if importlib.util.find_spec("llmctl.serve.engine.llm") is None:
            backends.remove("llmctl")
    builds = ensure_engines(args, backends)
    prompts = make_prompts(args)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE",
           "TOKENIZERS_PARALLELISM": "false"}
    results = []
    for backend in backends:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", backend, "--prompts",
               str(prompts)]
        print(f"running {backend} (load {load()})", flush=True)
        record = {"name": backend}
        with common.measured_round(record, args.threads):
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if proc.returncode != 0:
            results.append({"backend": backend, "error": proc.stderr.strip()[-500:],
                            "round": record})
            continue
        results.append({**json.loads(proc.stdout.strip().splitlines()[-1]), "round": record})
        print(json.dumps({k: v for k, v in results[-1].items() if k != "batch1_tokens"}),
              flush=True)
    report(args, results, builds, frame)


if __name__ == "__main__":
    main()
