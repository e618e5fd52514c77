"""Mixture-of-experts decode speed (issue 35): the engine against the read-bandwidth bound
counted on the active experts, and against llama.cpp on the same model's GGUF export.

The model: random bfloat16 weights (normal, std 0.02) of a Qwen3-MoE-shaped checkpoint
that fits here: Qwen3-30B-A3B's attention and expert widths (hidden 2048, 32 query and 4
KV heads of 128, experts 768 wide, 8 routed per token) with 64 experts instead of 128 and
4 layers (about 1.5 B parameters in all, 0.35 B read per token) and SmolLM2's
tokenizer and 49k vocabulary. Random router weights spread the tokens over the experts.
llama.cpp reads the same weights from llmctl's BF16 GGUF export of that checkpoint (the
exporter's float path: the tensors' bytes unchanged).

Both sides run greedy decode with ``--threads`` threads, each round in a fresh process
(nothing one side left in memory or the caches lasts into the other's round), the sides
alternating (``common.rotation``), every round reported:

- **batch 1**: tokens/s over ``DECODE_TOKENS`` tokens after a 48-token prompt (first to
  last token). The engine's round also measures ``read_bandwidth.py``'s read loop over
  one token's bytes right before and after it; its bound is the higher rate divided by
  the bytes a decode step reads: every dense weight, the routers, and ``k`` of each
  layer's ``E`` experts (``LlamaModel.bytes_read_per_step``), the head once, one
  embedding row. Target: >= 70 % of the bound; and at least level with llama.cpp.
- **32 sequences**: 32 prompts of 10-14 tokens, 64 new tokens each, all at once, the
  wall time from submitting the prompts to the last token (prefill included): the engine
  through ``LLM.generate``, llama.cpp through its batch API (one ``llama_decode`` per
  step over the 32 sequences' tokens, argmax of each row's logits). Target: at least
  level with llama.cpp.

    python benchmarks/moe_perf.py --rounds 3
    python benchmarks/moe_perf.py --scale small --rounds 1 --out-dir /tmp/moe
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
from family_perf import decode_rate, prompts
from read_bandwidth import read_bandwidth

DECODE_TARGET, VS_LLAMACPP_TARGET = 0.70, 1.0
VOCAB = 49152  # the tokenizer's (SmolLM2): llama.cpp checks the table against it
DECODE_TOKENS, PROMPT_TOKENS, BATCH, NEW_TOKENS = 64, 48, 32, 64
SHAPE = dict(model_type="qwen3_moe", hidden_size=2048, num_attention_heads=32,
             num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
             intermediate_size=6144, num_experts=64, num_experts_per_tok=8,
             norm_topk_prob=True, num_hidden_layers=4, rms_norm_eps=1e-6,
             rope_theta=1_000_000.0, max_position_embeddings=4096, decoder_sparse_step=1,
             mlp_only_layers=[])
SMALL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
             num_hidden_layers=2)

LLAMACPP_WORKER = r"""
import json, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama

cfg = json.loads(sys.argv[1])
t = cfg["threads"]
llm = Llama(model_path=cfg["gguf"], n_threads=t, n_threads_batch=t, n_ctx=256, verbose=False)

def batch1():
    stamps = []
    for _ in llm.generate(cfg["prompt"], temp=0.0, top_k=1, reset=True):
        stamps.append(time.perf_counter())
        if len(stamps) == cfg["n"]:
            break
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])

def batched(work, new):
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = len(work) * 128
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = len(work)
    params.n_threads = params.n_threads_batch = t
    ctx = llama_cpp.llama_init_from_model(llm.model, params)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm.model))
    batch = llama_cpp.llama_batch_init(512, 0, len(work))

    def decode(entries):  # one llama_decode: the rows with logits are indexed in it
        if len(entries) > 512:
            raise SystemExit("more than one batch of tokens per step")
        batch.n_tokens = len(entries)
        for i, (tok, pos, seq, want) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, want
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        return [i for i, e in enumerate(entries) if e[3]]

    def argmaxes(rows):
        return [int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, r),
                                          shape=(n_vocab,)).argmax()) for r in rows]

    start = time.perf_counter()
    entries = [(tok, j, s, j == len(p) - 1) for s, p in enumerate(work) for j, tok in enumerate(p)]
    rows = decode(entries)  # prefill: every prompt, the last token of each with logits
    pos, produced = [len(p) for p in work], 0
    outs = [[] for _ in work]
    while True:
        tokens = argmaxes(rows)
        for s, tok in enumerate(tokens):
            outs[s].append(tok)
        produced += 1
        if produced == new:
            break
        rows = decode([(tok, pos[s], s, True) for s, tok in enumerate(tokens)])
        pos = [x + 1 for x in pos]
    wall = time.perf_counter() - start
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    return wall, outs

if cfg["mode"] == "batch1":
    batch1()  # warm-up
    print(json.dumps({"tok_s": batch1()}))
else:
    batched(cfg["work"][:2], 4)  # warm-up
    wall, outs = batched(cfg["work"], cfg["n"])
    print(json.dumps({"wall_s": wall, "first": outs[0][:8]}))
"""


def build(out: Path, scale: str) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmctl.models.loading import load_tokenizer
    from llmctl.models.resolve import resolve_model

    shape = dict(SHAPE, **(SMALL if scale == "small" else {}))
    config = AutoConfig.for_model(**shape, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=2, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02)
    model.save_pretrained(str(out))
    load_tokenizer(Path(resolve_model("smollm2-135m").path)).save_pretrained(str(out))
    return out


def engine_worker(cfg: dict) -> dict:
    from llmctl.serve.core.sampling_params import SamplingParams
    from llmctl.serve.engine.llm import LLM

    if cfg["mode"] == "batch1":
        prompt = cfg["prompt"]
        llm = LLM(cfg["model"], dtype="bfloat16", kv_cache_memory="128MiB", max_num_seqs=1,
                  max_model_len=len(prompt) + cfg["n"] + 8)
        decode_rate(llm, prompt, 8)  # warm-up
        model = llm.engine.target.model
        read = model.bytes_read_per_step
        mib = -(-int(read) // 2**20)
        before = read_bandwidth(mib)
        rate = decode_rate(llm, prompt, cfg["n"])
        bound = max(before, read_bandwidth(mib))
        return {"tok_s": rate, "bytes_read_per_token": read, "read_bandwidth_bytes_s": bound,
                "fraction": read * rate / bound, "bytes_held": model.nbytes}
    llm = LLM(cfg["model"], dtype="bfloat16", enable_prefix_caching=False,
              max_num_seqs=len(cfg["work"]))
    params = SamplingParams(temperature=0, max_tokens=cfg["n"], ignore_eos=True)
    llm.generate(cfg["work"][:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    outs = llm.generate(cfg["work"], params)
    return {"wall_s": time.perf_counter() - start, "first": outs[0].outputs[0].token_ids[:8]}


def spawn(side: str, cfg: dict, threads: int) -> dict:
    env = common.thread_env(threads)
    cmd = ([sys.executable, "-c", LLAMACPP_WORKER, json.dumps(cfg)] if side == "llama.cpp"
           else [sys.executable, __file__, "--worker", json.dumps(cfg)])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} {cfg['mode']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(model: Path, gguf: Path, rounds: int, threads: int) -> list[dict]:
    work = prompts()
    prompt = prompts(1)[0] * 4
    prompt = prompt[:PROMPT_TOKENS]
    modes = {"batch1": {"prompt": prompt, "n": DECODE_TOKENS},
             "batch32": {"work": work, "n": NEW_TOKENS}}
    records = []
    for rnd in range(1, rounds + 1):
        for mode, base in modes.items():
            for side in common.rotation(["engine", "llama.cpp"], rnd):
                cfg = dict(base, mode=mode, threads=threads, model=str(model), gguf=str(gguf))
                record = {"name": f"{mode} {side} round {rnd}", "mode": mode, "side": side,
                          "round": rnd}
                with common.measured_round(record, threads):
                    record.update(spawn(side, cfg, threads))
                if mode == "batch32":
                    record["tok_s"] = BATCH * NEW_TOKENS / record["wall_s"]
                records.append(record)
                print(f"  {record['name']}: {record['tok_s']:.1f} tok/s"
                      + (f", {record['fraction']:.0%} of the bound" if "fraction" in record
                         else ""), file=sys.stderr, flush=True)
    return records


def summary(records: list[dict]) -> dict:
    out = {}
    for mode in ("batch1", "batch32"):
        ratios = []
        for rnd in sorted({r["round"] for r in records}):
            pair = {r["side"]: r for r in records if r["mode"] == mode and r["round"] == rnd}
            ratios.append(pair["engine"]["tok_s"] / pair["llama.cpp"]["tok_s"])
        out[mode] = {"engine_vs_llamacpp_median": common.median(ratios),
                     "engine_vs_llamacpp_min": min(ratios), "ratios": ratios,
                     "engine_tok_s_median": common.median(
                         [r["tok_s"] for r in records if r["mode"] == mode
                          and r["side"] == "engine"]),
                     "llamacpp_tok_s_median": common.median(
                         [r["tok_s"] for r in records if r["mode"] == mode
                          and r["side"] == "llama.cpp"])}
    out["batch1"]["fraction_median"] = common.median(
        [r["fraction"] for r in records if "fraction" in r])
    return out


def markdown(report: dict) -> str:
    b1, b32 = report["summary"]["batch1"], report["summary"]["batch32"]
    first = next(r for r in report["rounds"] if "bytes_read_per_token" in r)
    lines = common.header_markdown(report, "Mixture-of-experts decode (Qwen3-MoE shapes, "
                                           "random bf16 weights)")
    lines += [f"Model: {json.dumps(report['config']['shape'])}; held "
              f"{first['bytes_held'] / 1e9:.2f} GB, read per decode step "
              f"{first['bytes_read_per_token'] / 1e6:.0f} MB (the active experts).", "",
              "| measure | engine | llama.cpp | engine / llama.cpp (median; min) | target |",
              "|---|---|---|---|---|",
              (f"| batch-1 decode tok/s | {b1['engine_tok_s_median']:.1f} "
               f"({b1['fraction_median']:.0%} of the bound; target >= {DECODE_TARGET:.0%}) | "
               f"{b1['llamacpp_tok_s_median']:.1f} | {b1['engine_vs_llamacpp_median']:.2f}x; "
               f"{b1['engine_vs_llamacpp_min']:.2f}x | >= {VS_LLAMACPP_TARGET:.1f}x |"),
              (f"| 32 sequences x {NEW_TOKENS} tokens, tok/s | {b32['engine_tok_s_median']:.1f} | "
               f"{b32['llamacpp_tok_s_median']:.1f} | {b32['engine_vs_llamacpp_median']:.2f}x; "
               f"{b32['engine_vs_llamacpp_min']:.2f}x | >= {VS_LLAMACPP_TARGET:.1f}x |"),
              "", "Every round (each in its own process):", "",
              "| round | tok/s | of the bound | read bandwidth (GB/s) | load before / after | "
              "other procs (cores) |", "|---|---|---|---|---|---|"]
    for r in report["rounds"]:
        bw = r.get("read_bandwidth_bytes_s")
        lines.append(f"| {r['name']} | {r['tok_s']:.1f} | "
                     f"{'' if 'fraction' not in r else format(r['fraction'], '.0%')} | "
                     f"{'' if bw is None else f'{bw / 1e9:.1f}'} | "
                     f"{r['load_before'][0]} / {r['load_after'][0]} | "
                     f"{r['foreign_cpu_cores']} |")
    return "\n".join(lines + ["", "Raw numbers: the JSON file next to this one.", ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--scale", choices=("full", "small"), default="full")
    common.add_run_arguments(ap)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        import torch

        cfg = json.loads(args.worker)
        torch.set_num_threads(cfg["threads"])
        print(json.dumps(engine_worker(cfg)))
        return 0
    shape = dict(SHAPE, **(SMALL if args.scale == "small" else {}))
    report = common.start_run("moe-perf", {"rounds": args.rounds, "scale": args.scale,
                                           "shape": shape, "vocab": VOCAB},
                              allow_dirty=args.allow_dirty, threads=args.threads,
                              out=Path(args.out_dir))
    from llmctl.gguf.export import quantize_to_gguf

    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "model", args.scale)
        gguf = quantize_to_gguf(model, Path(tmp) / "model-bf16.gguf", "BF16")["path"]
        report["rounds"] = run(model, Path(gguf), args.rounds, args.threads)
    report["summary"] = summary(report["rounds"])
    common.finish_run(report, report["rounds"])
    print(common.write_report(Path(args.out_dir), "moe-perf", report, markdown(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
