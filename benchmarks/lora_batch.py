"""What serving several LoRA adapters in one batch costs: output tokens/s of a batch
whose requests are spread over 4 adapters against the same requests on the base model
alone, in one engine, rotating the order.

    python benchmarks/lora_batch.py                      # 3 rounds of mixed, mixed-torch, base
    python benchmarks/lora_batch.py --rounds 1 --num-prompts 4 --input-len 16 \\
        --output-len 8 --out-dir /tmp/lora-smoke --allow-dirty     # a smoke run

Model: SmolLM2-135M (``--dtype``, bfloat16 by default) on the offline engine
(:class:`llmctl.serve.engine.llm.LLM`), max_num_seqs = the prompt count (every request in one
batch), prefix caching off (rounds repeat the prompts: a hit would skip the next round's
prefill), ``--max-loras 4``, one torch thread per CPU this process may use.

Adapters: 4 random LoRAs of rank 8 (alpha 16, every q/k/v/o/gate/up/down projection)
made with PEFT on the model itself, seeds 1-4 (``lora_A`` and ``lora_B`` drawn with std
0.02: PEFT's zero ``lora_B`` would make an adapter a no-op). Made once per run, into the
log directory.

Workload: ``--num-prompts`` random prompts of ``--input-len`` token ids (seeded),
``--output-len`` tokens out, EOS ignored, greedy. "mixed": request ``i`` runs adapter
``i % 4`` (each step holds all four adapters: one small matmul pair per adapter and
fused linear, :mod:`llmctl.serve.lora.batch`); "base": the same requests, no adapter.
Decode steps of "mixed" run the fused native decode layers (bf16) with the adapters' sums
inside them (csrc/lora.cpp). "mixed-torch": the same requests with that kernel switched
off in this process (``lora_batch.lora_kernel`` returns None), so the adapters' sums are
torch products and steps with adapter rows take the Python layer loop, as before the
kernel existed: the kernel's gain, measured in the same run.

Each round runs the three sides back to back, round r starting with side r (rotating);
throughput is output tokens / the wall time of ``LLM.generate`` (model load and adapter
load excluded); the ratios against base are taken within a round, the summary is the
median over rounds. Every round records the load before/after and the CPU other
processes used (``common.py``).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402 (after the sys.path lines above)

fmt = common.fmt  # a table cell: '?' when not measured

SIDES = ("mixed", "mixed-torch", "base")
NUM_ADAPTERS = 4


@dataclass(frozen=True)
class Workload:
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 128
    seed: int = 0
    rank: int = 8


def make_adapters(model: Path, out: Path, rank: int) -> dict[str, str]:
    """The 4 random adapters (module docstring): name -> directory."""
    from tests.lora_adapters import build_adapter

    adapters = {}
    for i in range(1, NUM_ADAPTERS + 1):
        path = out / f"lora{i}"
        if not (path / "adapter_model.safetensors").is_file():
            build_adapter(model, path, rank=rank, alpha=2 * rank, seed=i, std=0.02)
        adapters[f"lora{i}"] = str(path)
    return adapters


def prompts(w: Workload, vocab: int) -> list[list[int]]:
    rng = random.Random(w.seed)
    return [[rng.randrange(10, vocab) for _ in range(w.input_len)]
            for _ in range(w.num_prompts)]


def run_side(llm, side: str, rnd: int, batch: list[list[int]], w: Workload,
             threads: int) -> dict:
    from llmctl.serve.core.sampling_params import SamplingParams
    from llmctl.serve.lora import batch as lora_batch

    names = [f"lora{i % NUM_ADAPTERS + 1}" for i in range(len(batch))] if side != "base" \
        else None
    params = SamplingParams(max_tokens=w.output_len, temperature=0, ignore_eos=True)
    record = {"name": f"round {rnd} {side}", "round": rnd, "side": side}
    kernel = lora_batch.lora_kernel
    if side == "mixed-torch":
        lora_batch.lora_kernel = lambda: None
    try:
        with common.measured_round(record, threads):
            start = time.perf_counter()
            outs = llm.generate(batch, params, lora=names)
            seconds = time.perf_counter() - start
    finally:
        lora_batch.lora_kernel = kernel
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if tokens != w.num_prompts * w.output_len:
        record["error"] = f"{tokens} output tokens, not {w.num_prompts * w.output_len}"
    record["result"] = {"output_throughput": tokens / seconds, "seconds": seconds,
                        "output_tokens": tokens}
    return record


def render_markdown(report: dict) -> str:
    cfg, res = report["config"], report["results"]
    w = cfg["workload"]
    lines = common.header_markdown(report, "LoRA: a batch mixing 4 adapters vs the base model")
    lines += [(f"SmolLM2 `{cfg['model']}` {cfg['dtype']}, offline engine, max_num_seqs "
               f"{w['num_prompts']}, prefix caching off; {NUM_ADAPTERS} random adapters of "
               f"rank {w['rank']} on every projection (mixed: request i runs adapter i % 4). "
               f"{w['num_prompts']} random prompts of {w['input_len']} tokens, "
               f"{w['output_len']} out, EOS ignored, greedy, seed {w['seed']}."),
              f"Adapters: `{cfg['adapter_dir']}`.", "",
              "| round | side | output tok/s | seconds | load before / after | "
              "other procs (cores) |", "|" + "---|" * 6]
    for r in res["runs"]:
        x = r["result"]
        note = f" (error: {r['error']})" if "error" in r else ""
        lines.append(f"| {r['round']} | {r['side']}{note} | "
                     f"{fmt(x['output_throughput'], '.1f')} | {x['seconds']:.2f} | "
                     f"{r['load_before'][0]} / {r['load_after'][0]} | "
                     f"{r['foreign_cpu_cores']} |")
    lines += [""] + common.ab_markdown(res["per_round"], res["summary"],
                                       [(side, side) for side in SIDES],
                                       [("mixed_over_base", "mixed / base"),
                                        ("mixed-torch_over_base", "mixed-torch / base")])
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=Workload.num_prompts)
    ap.add_argument("--input-len", type=int, default=Workload.input_len)
    ap.add_argument("--output-len", type=int, default=Workload.output_len)
    ap.add_argument("--rank", type=int, default=Workload.rank)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="smollm2")
    common.add_run_arguments(ap)
    args = ap.parse_args(argv)
    from llmctl.models.resolve import resolve_model
    from llmctl.serve.engine.llm import LLM

    model = resolve_model(args.model).path
    w = Workload(args.num_prompts, args.input_len, args.output_len, args.seed, args.rank)
    threads = len(common.cpus())
    log_dir = Path(f"/tmp/llmctl-lora-batch/{args.label}-{time.strftime('%Y%m%d-%H%M%S')}")
    log_dir.mkdir(parents=True, exist_ok=True)
    report = common.start_run("lora-batch", {
        "model": args.model, "model_path": str(model), "dtype": args.dtype,
        "workload": asdict(w), "rounds": args.rounds, "adapter_dir": str(log_dir),
        "order": "round r starts with side r of sides, rotating", "sides": list(SIDES)},
        allow_dirty=args.allow_dirty, threads=threads, out=args.out_dir)
    adapters = make_adapters(Path(model), log_dir, w.rank)
    llm = LLM(str(model), dtype=args.dtype, loras=adapters, max_loras=NUM_ADAPTERS,
              max_num_seqs=w.num_prompts, max_num_batched_tokens=max(2048, w.input_len),
              max_model_len=w.input_len + w.output_len + 1, kv_cache_memory="1GiB",
              enable_prefix_caching=False, num_threads=threads)
    batch = prompts(w, llm.engine.spec.vocab_size)
    runs = []
    for rnd in range(1, args.rounds + 1):
        for side in common.rotation(SIDES, rnd):
            print(f"[lora-batch] round {rnd} {side} ...", file=sys.stderr, flush=True)
            rec = run_side(llm, side, rnd, batch, w, threads)
            runs.append(rec)
            print(f"[lora-batch]   {rec['result']['output_throughput']:.1f} tok/s"
                  + (f" ({rec['error']})" if "error" in rec else ""), file=sys.stderr,
                  flush=True)
    per_round, summary = common.against_base(runs, args.rounds, SIDES[:2], "base",
                                             "{}_over_base")
    report["results"] = {"runs": runs, "per_round": per_round, "summary": summary}
    common.finish_run(report, runs)
    markdown = render_markdown(report)
    common.write_report(Path(args.out_dir), f"lora-batch-{args.label}", report, markdown)
    print(markdown)
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
