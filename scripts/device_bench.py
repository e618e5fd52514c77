"""scripts/device-check's short benchmark: run by it as a subprocess, writes one JSON.

1. Decode: llmctl's engine at batch 1 and 64 and transformers ``generate`` on the same
   random-weight model (the shipped config's shape, bf16), alternating engine and
   baseline each round so drift (clocks, other load) hits both; MFU/MBU of decode against
   the peaks the project's table holds for this GPU (llmctl.perf.devices), both from the
   same cost model (llmctl.perf.costs): FLOPs and bytes (weights + the KV each token
   reads) per decode step over the measured decode seconds.
2. GPTQ: one Llama-3-8B-shaped layer (hidden 4096, 32/8 heads, MLP 14336), W4 group 128,
   on the device, and its q_proj also on the CPU, with the codes' agreement.

Decode seconds: the engine's own meter (llmctl.perf.meter, steps with generated tokens
only); transformers' from two timed calls, ``max_new_tokens=N`` minus ``=1`` (prefill and
the first token) over N - 1 steps. Random weights decode random tokens: ``ignore_eos`` /
``min_new_tokens`` fix every sequence at N tokens.

``--quick`` shrinks everything (the dry run on a CPU): the numbers then only prove the
code runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

# Llama-3-8B's layer: (name, rows = out features, cols = in features)
LLAMA3_8B_LAYER = (("q_proj", 4096, 4096), ("k_proj", 1024, 4096), ("v_proj", 1024, 4096),
                   ("o_proj", 4096, 4096), ("gate_proj", 14336, 4096),
                   ("up_proj", 14336, 4096), ("down_proj", 4096, 14336))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def random_checkpoint(config_dir: Path, out: Path, device: torch.device, layers: int | None):
    """A checkpoint of the config's shape with random bf16 weights, and its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_dir))
    if layers:
        config.num_hidden_layers = layers
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for f in config_dir.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return model, config


def decode_load(cost, batch: int, prompt: int, steps: int):
    """FLOPs and bytes of ``steps`` decode steps of ``batch`` sequences after ``prompt``
    tokens (each step reads the weights once and every sequence's KV so far)."""
    flops = bytes_ = 0.0
    for j in range(steps):
        contexts = [prompt + j + 1] * batch
        flops += cost.decode_step_flops(contexts)
        bytes_ += cost.decode_step_bytes(contexts)
    return flops, bytes_


def utilization(flops: float, bytes_: float, seconds: float, peaks) -> dict:
    out = {"decode_seconds": seconds, "achieved_tflops": flops / seconds / 1e12 if seconds else None,
           "achieved_gb_per_s": bytes_ / seconds / 1e9 if seconds else None,
           "mfu": None, "mbu": None}
    if peaks is not None and seconds:
        peak_f = peaks.flops_for("bf16")
        out["mfu"] = flops / seconds / peak_f if peak_f else None
        out["mbu"] = bytes_ / seconds / peaks.bandwidth if peaks.bandwidth else None
    return out


def engine_run(llm, batch: int, prompt_ids: list[list[int]], new: int, cost, peaks) -> dict:
    from llmctl.serve.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    before = llm.engine.stats().perf_totals["decode"]
    t0 = time.perf_counter()
    outs = llm.generate(prompt_ids[:batch], params)
    wall = time.perf_counter() - t0
    after = llm.engine.stats().perf_totals["decode"]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    seconds = after.seconds - before.seconds
    flops, bytes_ = decode_load(cost, batch, len(prompt_ids[0]), new - 1)
    return {"batch": batch, "tokens": tokens, "wall_seconds": wall,
            "tokens_per_s": tokens / wall, "decode_tokens_per_s": batch * (new - 1) / seconds,
            **utilization(flops, bytes_, seconds, peaks)}


def hf_run(model, batch: int, prompt_ids: list[list[int]], new: int, cost, peaks,
           device: torch.device, pad_id: int) -> dict:
    ids = torch.tensor(prompt_ids[:batch], device=device)
    mask = torch.ones_like(ids)

    def timed(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=pad_id)
        sync(device)
        return time.perf_counter() - t0

    first = timed(1)
    wall = timed(new)
    seconds = max(wall - first, 1e-9)
    flops, bytes_ = decode_load(cost, batch, len(prompt_ids[0]), new - 1)
    return {"batch": batch, "tokens": batch * new, "wall_seconds": wall,
            "tokens_per_s": batch * new / wall, "decode_tokens_per_s": batch * (new - 1) / seconds,
            **utilization(flops, bytes_, seconds, peaks)}


def bench_decode(config_dir: Path, device: torch.device, quick: bool, peaks) -> dict:
    from llmctl.perf.costs import ArchSpec, ModelCost
    from llmctl.serve.engine.llm import LLM

    batches = (1, 4) if quick else (1, 64)
    prompt_len, new, rounds = (16, 8, 1) if quick else (128, 128, 3)
    work = Path(tempfile.mkdtemp(prefix="device-bench-"))
    try:
        model, _config = random_checkpoint(config_dir, work / "model", device,
                                          layers=2 if quick else None)
        cfg = json.loads((work / "model" / "config.json").read_text())
        cost = ModelCost(ArchSpec.from_config(cfg), kv_bytes=2)  # bf16 weights and cache
        gen = torch.Generator().manual_seed(0)
        vocab = int(cfg["vocab_size"])
        prompts = torch.randint(100, vocab, (max(batches), prompt_len), generator=gen).tolist()
        llm = LLM(str(work / "model"), device=device.type, dtype="bfloat16",
                  kv_cache_dtype="bfloat16", max_num_seqs=max(batches),
                  max_model_len=prompt_len + new + 16, enable_prefix_caching=False,
                  kv_cache_memory="256MiB" if quick else "4GiB")
        engine_run(llm, 1, prompts, 4, cost, peaks)  # warm-up: allocator, kernels
        pad = int(cfg.get("pad_token_id") or cfg.get("eos_token_id") or 0)
        if isinstance(cfg.get("eos_token_id"), list):
            pad = int(cfg["eos_token_id"][0])
        hf_run(model, 1, prompts, 2, cost, peaks, device, pad)
        runs: dict[str, list[dict]] = {}
        for _ in range(rounds):
            for b in batches:  # alternating: engine, then transformers, at each batch
                runs.setdefault(f"engine_b{b}", []).append(
                    engine_run(llm, b, prompts, new, cost, peaks))
                runs.setdefault(f"transformers_b{b}", []).append(
                    hf_run(model, b, prompts, new, cost, peaks, device, pad))
        summary = {}
        for key, rows in runs.items():
            best = statistics.median(r["decode_tokens_per_s"] for r in rows)
            row = min(rows, key=lambda r: abs(r["decode_tokens_per_s"] - best))  # the median run
            summary[key] = {**row, "rounds": [r["decode_tokens_per_s"] for r in rows]}
        for b in batches:
            e, h = summary[f"engine_b{b}"], summary[f"transformers_b{b}"]
            summary[f"engine_vs_transformers_b{b}"] = (e["decode_tokens_per_s"]
                                                       / h["decode_tokens_per_s"])
        return {"model": {"config": str(config_dir), "layers": cfg["num_hidden_layers"],
                          "hidden": cfg["hidden_size"], "vocab": vocab, "dtype": "bfloat16",
                          "weights": "random (torch.manual_seed(0))"},
                "prompt_len": prompt_len, "new_tokens": new, "rounds": rounds,
                "results": summary}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench_gptq(device: torch.device, quick: bool, cpu_reference: bool) -> dict:
    from llmctl.quant.gptq import gptq_quantize
    from llmctl.quant.hessian import HessianAccumulator
    from llmctl.quant.rtn import IntGrid

    shrink = 16 if quick else 1
    tokens = 256 if quick else 2048
    grid = IntGrid(4, True, 128 // (4 if quick else 1))
    gen = torch.Generator().manual_seed(0)
    rows_out, total = [], 0.0
    hessians: dict[int, torch.Tensor] = {}
    q_proj = None
    for name, rows, cols in LLAMA3_8B_LAYER:
        rows, cols = rows // shrink, cols // shrink
        if cols not in hessians:  # one calibration input per input width, as in a layer
            x = torch.randn(tokens, cols, generator=gen).to(device)
            acc = HessianAccumulator(cols, device)
            acc.add(x)
            hessians[cols] = acc.hessian()
        w = (torch.randn(rows, cols, generator=gen) * 0.02).to(device)
        sync(device)
        t0 = time.perf_counter()
        result = gptq_quantize(w, hessians[cols], grid)
        sync(device)
        seconds = time.perf_counter() - t0
        total += seconds
        rows_out.append({"name": name, "shape": [rows, cols], "seconds": seconds,
                         "fallback": result.fallback})
        if name == "q_proj":
            q_proj = (w.cpu(), hessians[cols].cpu(), result.q.cpu())
    out = {"grid": f"int4 symmetric, group {grid.group_size}", "calibration_tokens": tokens,
           "device": device.type, "layer_seconds": total, "linears": rows_out,
           "shape": "Llama-3-8B layer" + (" / 16 (quick)" if quick else "")}
    if cpu_reference and q_proj is not None:
        w, H, q_dev = q_proj
        t0 = time.perf_counter()
        q_cpu = gptq_quantize(w, H, grid).q
        out["q_proj_cpu_seconds"] = time.perf_counter() - t0
        out["q_proj_cpu_threads"] = torch.get_num_threads()
        out["q_proj_code_agreement"] = (q_cpu == q_dev).float().mean().item()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, required=True, help="a config.json + tokenizer dir")
    ap.add_argument("--out", type=Path, required=True, help="where the JSON goes")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a dry run)")
    args = ap.parse_args(argv)

    from llmctl.perf import devices

    device = torch.device(args.device)
    peaks = devices.detect_gpu_peaks() if device.type == "cuda" else None
    result: dict = {"device": device.type, "quick": args.quick,
                    "peaks": None if peaks is None else {
                        "source": peaks.source, "bf16_flops": peaks.flops_for("bf16"),
                        "bandwidth": peaks.bandwidth},
                    "definitions": {
                        "decode_tokens_per_s": "batch x (N - 1) / decode seconds",
                        "mfu": "decode FLOPs (llmctl.perf.costs) / decode seconds / bf16 peak",
                        "mbu": "decode bytes (weights per step + KV read) / decode seconds "
                               "/ peak bandwidth"}}
    sections = {"decode": lambda: bench_decode(args.config, device, args.quick, peaks),
                "gptq": lambda: bench_gptq(device, args.quick,
                                           cpu_reference=device.type == "cuda")}
    status = 0
    for name, run in sections.items():
        t0 = time.perf_counter()
        try:
            result[name] = {"status": "ok", **run()}
        except Exception as exc:  # noqa: BLE001 (a failed section is a record, not a lost report)
            import traceback

            traceback.print_exc()
            result[name] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
            status = 1
        result[name]["seconds"] = time.perf_counter() - t0
        args.out.write_text(json.dumps(result, indent=2, default=str))  # partial results
        print(f"{name}: {result[name]['status']} in {result[name]['seconds']:.1f} s", flush=True)
    return status


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
