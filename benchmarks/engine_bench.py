"""Benchmarks of the built-in engine (issue 4), each comparison measured in the same run.

    python benchmarks/engine_bench.py                     # everything, full scale
    python benchmarks/engine_bench.py --dtype bfloat16 --parts throughput --rounds 3
    python benchmarks/engine_bench.py --scale small --out-dir /tmp/smoke   # a smoke run

Parts (each runs in its own subprocess, so memory and threads do not leak between them):

- ``throughput``: offline output tokens/s for mixed requests (prompts 32-512 tokens, outputs
  32-256, EOS ignored so both sides produce the same tokens) on the engine, against
  transformers ``generate`` with static batching (arrival order, left padding) at its
  best batch size. The best size is swept on the whole workload (see ``batch_sweep.py``)
  until it has a worse neighbour on both sides, or the failed size (out of memory) or
  the limit (all requests in one batch) on the side that has none is stated. Then
  ``--rounds`` alternating rounds, engine first in odd rounds and transformers first in
  even ones (A B B A ...), each in a fresh process: every engine round is a fresh engine with prefix caching off (so no round
  reuses another's prefill), warmed up on other prompts. Every round is reported; the
  headline is the median of the per-round ratios (engine round i / transformers round
  i). Also the KV memory waste of the engine during the run: allocated-but-empty slots
  / allocated slots in blocks owned by running sequences, averaged over steps.
- ``decode``: batch-1 decode tokens/s (time from the first to the last token over the
  tokens in between) and the fraction of the memory-bandwidth limit it reaches:
  ``bytes read per token x tokens/s / copy bandwidth`` (bytes read + written per second
  by a large ``Tensor.copy_``), where the bytes read per token count what a decode step
  reads (``decode_bytes.py``: every matmul weight once, one row of the embedding table;
  a tied table once, as the lm_head). transformers batch-1 decode for reference.
- ``prefix``: time to first token of requests that share a 400-token prefix, prefix
  caching on vs off (requests one at a time, after one warm-up request).
- ``quant``: a W4A16 checkpoint (compressed-tensors ``pack-quantized``, int4 group 64,
  round-to-nearest: only the speed and size matter here) against float32 and bfloat16
  on the same engine: batch-1 decode tokens/s and the process's peak RSS.
- ``spec``: speculative decoding (n-gram prompt lookup) at batch 1 on an input-grounded
  task (copy a passage), greedy, against plain decoding: speedup, acceptance rate, and
  that the outputs are identical.

Results go to ``results/engine-bench-<label>.json`` and ``.md`` with the exact command,
commit (a dirty tree is refused unless ``--allow-dirty``, and then marked), thread
settings, and per part / round the load average before and after and the CPU other
processes used meanwhile (``common.py``: a round is contended when that passes a
quarter of a core).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common
from batch_sweep import best_size, bracket, next_batch_size
from decode_bytes import bytes_read_per_token, llmctl_model_reads

SCALES = {
    "full": dict(num_requests=128, prompt_range=(32, 512), output_range=(32, 256),
                 hf_batch_start=16, decode_tokens=128, prefix_requests=8, spec_tokens=192,
                 quant_tokens=128),
    "small": dict(num_requests=12, prompt_range=(16, 96), output_range=(8, 32),
                  hf_batch_start=4, decode_tokens=24, prefix_requests=3, spec_tokens=48,
                  quant_tokens=24),
}
PARTS = ("throughput", "decode", "prefix", "quant", "spec")


# --- shared helpers ------------------------------------------------------------------------
def corpus_ids(tokenizer) -> list[int]:
    """~100k tokens of stdlib prose (the larger of the two built-in pydoc splits)."""
    from llmctl.data.sources import load_text_source, token_stream

    return token_stream(tokenizer, load_text_source("builtin:pydoc-calib"))


def make_workload(ids: list[int], n: int, prompt_range, output_range, seed: int = 0):
    """``n`` (prompt token ids, output length) pairs; prompts are windows of real prose."""
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        start = rng.randint(0, len(ids) - plen - 1)
        work.append((ids[start:start + plen], rng.randint(*output_range)))
    return work


def rss_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process, from /proc/self/status.

    Not ``getrusage``: its maxrss survives ``exec``, so a worker spawned by a big parent
    would report the parent's peak."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields.get("VmRSS", 0.0), fields.get("VmHWM", 0.0)


def copy_bandwidth(size_mib: int = 512, repeats: int = 5) -> float:
    """Bytes read + written per second by a large tensor copy (best of ``repeats``)."""
    import torch

    src = torch.ones(size_mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best


def engine(model: str, **kwargs):
    from llmctl.serve.engine.llm import LLM

    return LLM(model, **kwargs)


def run_to_end(llm, requests, params_list, on_step=None) -> dict:
    """Add everything at once, step until done; per-request timestamps."""
    eng = llm.engine
    t0 = time.time()
    for i, (prompt, params) in enumerate(zip(requests, params_list)):
        eng.add_request(f"b{i}", prompt, params, arrival_time=t0)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if on_step is not None:
            on_step(eng)
    wall = time.time() - t0
    return {"wall_s": wall, "outputs": [done[f"b{i}"] for i in range(len(requests))]}


# --- workers -------------------------------------------------------------------------------
def _throughput_workload(cfg: dict):
    from llmctl.models.loading import load_tokenizer
    from llmctl.models.resolve import resolve_model

    path = str(resolve_model(cfg["model"]).path)
    scale = SCALES[cfg["scale"]]
    tok = load_tokenizer(Path(path))
    ids = corpus_ids(tok)
    work = make_workload(ids, scale["num_requests"], scale["prompt_range"],
                         scale["output_range"])
    # warm-up requests from another seed: nothing in them is reused by the measured run
    warm = make_workload(ids, 2, scale["prompt_range"], (4, 4), seed=12345)
    return path, tok, work, warm


def workload_summary(cfg: dict) -> dict:
    scale = SCALES[cfg["scale"]]
    _, _, work, _ = _throughput_workload(cfg)
    return {"requests": len(work), "prompt_tokens": sum(len(p) for p, _ in work),
            "output_tokens": sum(n for _, n in work), "prompt_range": scale["prompt_range"],
            "output_range": scale["output_range"]}


def worker_engine_throughput(cfg: dict) -> dict:
    """One engine round in a fresh process: a fresh engine, so nothing is cached."""
    from llmctl.serve.core.sampling_params import SamplingParams

    path, _, work, warm = _throughput_workload(cfg)
    scale = SCALES[cfg["scale"]]
    prompts = [p for p, _ in work]
    useful = sum(n for _, n in work)
    llm = engine(path, dtype=cfg["dtype"], kv_cache_memory=cfg["kv_cache_memory"],
                 max_num_seqs=cfg["max_num_seqs"],
                 max_num_batched_tokens=cfg["max_num_batched_tokens"],
                 max_model_len=scale["prompt_range"][1] + scale["output_range"][1],
                 enable_prefix_caching=cfg["prefix_caching"])
    run_to_end(llm, [p for p, _ in warm],
               [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in warm])
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    waste_samples = []

    def sample_waste(eng):
        stats = eng.stats()
        if stats.kv_slots_allocated:
            waste_samples.append((stats.kv_slots_allocated, stats.kv_slots_used))

    res = run_to_end(llm, prompts, params, sample_waste)
    got = sum(len(o.outputs[0].token_ids) for o in res["outputs"])
    if got != useful:
        raise RuntimeError(f"the engine produced {got} tokens, expected {useful}")
    alloc = sum(a for a, _ in waste_samples)
    used = sum(u for _, u in waste_samples)
    stats = llm.engine.stats()
    return {
        "wall_s": res["wall_s"], "output_tokens": got,
        "output_throughput": got / res["wall_s"],
        "total_throughput": (got + sum(len(p) for p in prompts)) / res["wall_s"],
        "kv_waste": 1 - used / alloc if alloc else None,
        "kv_waste_max_step": max((1 - u / a for a, u in waste_samples), default=None),
        "num_preemptions": stats.num_preemptions, "num_steps": stats.num_steps,
        "kv_cache_tokens": stats.kv_cache_tokens,
        "prefix_caching": cfg["prefix_caching"],
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        "ttft_median_s": sorted(o.metrics.first_token_time - o.metrics.arrival_time
                                for o in res["outputs"])[len(prompts) // 2],
    }


def worker_hf_throughput(cfg: dict) -> dict:
    """transformers at one batch size on the whole workload, in a fresh process: static
    batches in arrival order, left padding, every row generating its batch's longest
    output (only the requested tokens count as output)."""
    import torch

    from llmctl.models.loading import load_model

    path, tok, work, warm = _throughput_workload(cfg)
    batch_size = cfg["batch_size"]
    hf = load_model(Path(path), cfg["dtype"])
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def hf_run(reqs, bs) -> tuple[float, int]:
        start = time.perf_counter()
        tokens = 0
        for i in range(0, len(reqs), bs):
            chunk = reqs[i:i + bs]
            width = max(len(p) for p, _ in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for r, (p, _) in enumerate(chunk):
                ids[r, width - len(p):] = torch.tensor(p)
                mask[r, width - len(p):] = 1
            new = max(n for _, n in chunk)
            with torch.inference_mode():
                hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                            do_sample=False, pad_token_id=pad)
            tokens += sum(n for _, n in chunk)
        return time.perf_counter() - start, tokens

    hf_run(warm, 2)
    wall, tokens = hf_run(work, batch_size)
    _, peak = rss_mib()
    return {"batch_size": batch_size, "wall_s": wall, "output_tokens": tokens,
            "output_throughput": tokens / wall, "peak_rss_mib": peak}


def _failed_for_memory(result: dict) -> bool:
    """A worker killed by the OOM killer (SIGKILL) or refused an allocation."""
    text = result.get("error", "").lower()
    return result.get("returncode") == -9 or any(
        s in text for s in ("out of memory", "can't allocate memory", "cannot allocate memory",
                            "memoryerror"))


def run_throughput(cfg: dict, rounds: int) -> tuple[dict, list[dict]]:
    """The transformers sweep, then alternating engine / transformers rounds."""
    scale = SCALES[cfg["scale"]]
    limit = scale["num_requests"]  # a larger batch is the same single batch
    records: list[dict] = []
    sweep: dict[int, float | None] = {}
    sweep_runs = []
    while (bs := next_batch_size(sweep, start=scale["hf_batch_start"], limit=limit)) is not None:
        record = {"name": f"sweep transformers batch {bs}", "part": "throughput-sweep"}
        with common.measured_round(record, cfg["threads"]):
            record["result"] = spawn("hf_throughput", {**cfg, "batch_size": bs})
        result = record["result"]
        _progress(record)
        records.append(record)
        sweep_runs.append(record)
        if "error" in result:
            if not _failed_for_memory(result):
                return {"error": f"transformers at batch {bs} failed: {result['error']}",
                        "sweep": sweep_runs}, records
            sweep[bs] = None
        else:
            sweep[bs] = result["output_throughput"]
    best = best_size(sweep)
    out = {"workload": workload_summary(cfg), "transformers_sweep_tok_s": sweep,
           "transformers_sweep": sweep_runs, "best_batch_size": best,
           "bracket": bracket(sweep, limit=limit), "limit_note":
           f"batch {limit} puts all {limit} requests in one batch: larger is the same run",
           "rounds": []}
    if best is None:
        out["error"] = "transformers failed at every batch size"
        return out, records
    for i in range(rounds):
        pair = {"round": i + 1}
        sides = (("engine", "engine_throughput", {}),
                 ("transformers", "hf_throughput", {"batch_size": best}))
        # the side that runs first alternates (engine first in odd rounds)
        for side, part, extra in sides if i % 2 == 0 else sides[::-1]:
            record = {"name": f"round {i + 1} {side}", "part": "throughput"}
            with common.measured_round(record, cfg["threads"]):
                record["result"] = spawn(part, {**cfg, **extra})
            _progress(record)
            records.append(record)
            pair[side] = record
            pair.setdefault("order", []).append(side)
        e, h = pair["engine"]["result"], pair["transformers"]["result"]
        if "output_throughput" in e and "output_throughput" in h:
            pair["engine_vs_transformers"] = e["output_throughput"] / h["output_throughput"]
        out["rounds"].append(pair)

    def rates(side: str) -> list[float]:
        return [p[side]["result"]["output_throughput"] for p in out["rounds"]
                if "output_throughput" in p[side]["result"]]

    out["engine_median_tok_s"] = common.median(rates("engine"))
    out["transformers_median_tok_s"] = common.median(rates("transformers"))
    out["speedup_median"] = common.median([p.get("engine_vs_transformers")
                                           for p in out["rounds"]])
    return out, records


def _progress(record: dict) -> None:
    r = record["result"]
    what = (f"{r['output_throughput']:.1f} tok/s" if "output_throughput" in r
            else f"error {r.get('error', '')[-200:]!r}")
    print(f"[engine-bench] {record['name']}: {what} (load before {record['load_before'][0]}, "
          f"other processes {record['foreign_cpu_cores']} cores)", file=sys.stderr, flush=True)


def _decode_rate(llm, prompt, n) -> float:
    from llmctl.serve.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    stamps = []
    for out in llm.stream([prompt], params):
        stamps.extend([time.perf_counter()] * len(out.outputs[0].new_token_ids))
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def worker_decode(cfg: dict) -> dict:
    import torch

    from llmctl.models.loading import load_model, load_tokenizer
    from llmctl.models.resolve import resolve_model

    path = str(resolve_model(cfg["model"]).path)
    scale = SCALES[cfg["scale"]]
    tok = load_tokenizer(Path(path))
    prompt = corpus_ids(tok)[1000:1032]
    n = scale["decode_tokens"]
    llm = engine(path, dtype=cfg["dtype"], kv_cache_memory="128MiB", max_num_seqs=1,
                 max_model_len=len(prompt) + n)
    _decode_rate(llm, prompt, 8)
    rates = [_decode_rate(llm, prompt, n) for _ in range(2)]
    rate = max(rates)
    model = llm.engine.target.model
    resident = model.nbytes
    read_per_token = bytes_read_per_token(llmctl_model_reads(model))
    del llm, model
    bandwidth = copy_bandwidth()

    hf = load_model(Path(path), cfg["dtype"])
    ids = torch.tensor([prompt])

    def hf_time(new: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                        min_new_tokens=new, do_sample=False, pad_token_id=tok.eos_token_id)
        return time.perf_counter() - start

    hf_time(4)
    hf_rate = (n - 1) / (hf_time(n) - hf_time(1))
    return {"engine_tok_s": rate, "engine_runs_tok_s": rates, "transformers_tok_s": hf_rate,
            "bytes_read_per_token": read_per_token, "resident_weight_bytes": resident,
            "copy_bandwidth_bytes_s": bandwidth,
            "bandwidth_fraction": read_per_token * rate / bandwidth,
            "bound_tok_s": bandwidth / read_per_token, "prompt_tokens": len(prompt),
            "decode_tokens": n}


def worker_prefix(cfg: dict) -> dict:
    from llmctl.models.loading import load_tokenizer
    from llmctl.models.resolve import resolve_model
    from llmctl.serve.core.sampling_params import SamplingParams

    path = str(resolve_model(cfg["model"]).path)
    scale = SCALES[cfg["scale"]]
    tok = load_tokenizer(Path(path))
    ids = corpus_ids(tok)
    system = ids[5000:5400]
    rng = random.Random(1)
    suffixes = []
    for _ in range(scale["prefix_requests"] + 1):
        start = rng.randint(20000, len(ids) - 100)
        suffixes.append(ids[start:start + rng.randint(16, 48)])
    result = {"shared_prefix_tokens": len(system)}
    for caching in (False, True):
        llm = engine(path, dtype=cfg["dtype"], kv_cache_memory="256MiB", max_num_seqs=4,
                     max_model_len=512, enable_prefix_caching=caching,
                     max_num_batched_tokens=cfg["max_num_batched_tokens"])
        ttfts = []
        for i, suffix in enumerate(suffixes):
            out = llm.generate([system + suffix], SamplingParams(temperature=0, max_tokens=1))[0]
            if i:  # the first request only warms up (and fills the cache)
                ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
        key = "on" if caching else "off"
        result[f"ttft_{key}_s"] = ttfts
        result[f"mean_ttft_{key}_ms"] = 1000 * sum(ttfts) / len(ttfts)
        result[f"hit_rate_{key}"] = llm.engine.stats().prefix_cache_hit_rate
        del llm
    result["ttft_ratio"] = result["mean_ttft_off_ms"] / result["mean_ttft_on_ms"]
    return result


def write_w4a16(src: Path, dst: Path, group: int = 64) -> Path:
    """Round-to-nearest int4 (symmetric, group 64) in compressed-tensors pack-quantized."""
    import shutil

    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )
    from safetensors.torch import load_file, save_file

    if (dst / "config.json").exists():
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
        (tmp / f.name).unlink()
    out = {}
    for name, w in tensors.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith("proj.weight") and ".layers." in name:
            w = w.float()
            n, k = w.shape
            g = w.view(n, k // group, group)
            scale = (g.abs().amax(-1) / 7).clamp(min=1e-8)
            q = torch.round(g / scale[..., None]).clamp(-8, 7).to(torch.int8).view(n, k)
            out[f"{module}.weight_packed"] = pack_to_int32(q, 4)
            out[f"{module}.weight_scale"] = scale.to(torch.bfloat16)
            out[f"{module}.weight_shape"] = torch.tensor([n, k])
        else:
            out[name] = w
    save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=group)
    qc = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"],
                                                                         weights=args)},
                            format="pack-quantized", quantization_status="compressed",
                            ignore=["lm_head"])
    config = json.loads((tmp / "config.json").read_text())
    config["quantization_config"] = json.loads(qc.model_dump_json())
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(dst)
    return dst


def worker_quant_one(cfg: dict) -> dict:
    """One variant in its own process: decode tok/s and peak RSS."""
    from llmctl.models.loading import load_tokenizer

    scale = SCALES[cfg["scale"]]
    tok = load_tokenizer(Path(cfg["path"]))
    prompt = corpus_ids(tok)[1000:1032]
    n = scale["quant_tokens"]
    before, _ = rss_mib()
    llm = engine(cfg["path"], dtype=cfg["dtype"], kv_cache_memory="64MiB", max_num_seqs=1,
                 max_model_len=len(prompt) + n)
    _decode_rate(llm, prompt, 8)
    rate = max(_decode_rate(llm, prompt, n) for _ in range(2))
    model = llm.engine.target.model
    now, peak = rss_mib()
    return {"decode_tok_s": rate, "weight_bytes": model.nbytes, "peak_rss_mib": peak,
            "rss_mib": now, "rss_before_load_mib": before, "rss_of_engine_mib": now - before,
            "kv_cache_bytes": llm.engine.kv_plan.total_bytes}


def worker_quant(cfg: dict) -> dict:
    from llmctl.home import models_dir
    from llmctl.models.resolve import resolve_model

    src = resolve_model(cfg["model"]).path
    w4 = write_w4a16(src, models_dir() / f"{src.name}-w4a16-g64-rtn")
    variants = {"float32": (str(src), "float32"), "bfloat16": (str(src), "bfloat16"),
                "w4a16": (str(w4), "float32"), "w4a16-bf16": (str(w4), "bfloat16")}
    out = {"w4a16_checkpoint": str(w4)}
    for name, (path, dtype) in variants.items():
        out[name] = spawn("quant_one", {**cfg, "path": path, "dtype": dtype})
    out["w4a16_vs_float32_speed"] = out["w4a16"]["decode_tok_s"] / out["float32"]["decode_tok_s"]
    out["w4a16_vs_float32_rss"] = out["w4a16"]["rss_mib"] / out["float32"]["rss_mib"]
    return out


def worker_spec(cfg: dict) -> dict:
    from llmctl.models.loading import load_tokenizer
    from llmctl.models.prompting import encode_prompt
    from llmctl.models.resolve import resolve_model
    from llmctl.serve.core.sampling_params import SamplingParams

    path = str(resolve_model(cfg["model"]).path)
    scale = SCALES[cfg["scale"]]
    tok = load_tokenizer(Path(path))
    ids = corpus_ids(tok)
    passage = tok.decode(ids[8000:8250], skip_special_tokens=True)
    prompt = encode_prompt(tok, "Repeat the following text exactly, word for word:\n\n"
                           + passage, chat=True)
    n = scale["spec_tokens"]
    params = SamplingParams(temperature=0, max_tokens=n)
    out = {"prompt_tokens": len(prompt), "max_tokens": n}
    texts = {}
    for name, spec in (("plain", None),
                       ("ngram-k4", {"method": "ngram", "num_speculative_tokens": 4}),
                       ("ngram-k8", {"method": "ngram", "num_speculative_tokens": 8})):
        llm = engine(path, dtype=cfg["dtype"], kv_cache_memory="128MiB", max_num_seqs=1,
                     max_model_len=len(prompt) + n, speculative=spec)
        llm.generate([prompt[:64]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        start = time.perf_counter()
        res = llm.generate([prompt], params)[0].outputs[0]
        wall = time.perf_counter() - start
        stats = llm.engine.stats()
        texts[name] = res.token_ids
        out[name] = {"wall_s": wall, "tokens": len(res.token_ids),
                     "tok_s": len(res.token_ids) / wall,
                     "acceptance_rate": stats.spec_acceptance_rate,
                     "mean_accepted_per_step": stats.spec_mean_accepted_per_step}
        del llm
    out["identical_outputs"] = all(t == texts["plain"] for t in texts.values())
    for name in ("ngram-k4", "ngram-k8"):
        out[f"speedup_{name}"] = out["plain"]["wall_s"] / out[name]["wall_s"]
    out["copied_fraction"] = _overlap(tok.decode(texts["plain"]), passage)
    return out


def _overlap(text: str, passage: str) -> float:
    words = text.split()
    return sum(1 for w in words if w in passage) / max(len(words), 1)


WORKERS = {"engine_throughput": worker_engine_throughput, "hf_throughput": worker_hf_throughput,
           "decode": worker_decode, "prefix": worker_prefix, "quant": worker_quant,
           "quant_one": worker_quant_one, "spec": worker_spec}


def spawn(part: str, cfg: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", part, "--config",
                           json.dumps(cfg)], capture_output=True, text=True,
                          env=common.thread_env(cfg["threads"]), check=False)
    if proc.returncode != 0:
        return {"error": proc.stderr[-3000:], "returncode": proc.returncode}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- report --------------------------------------------------------------------------------
def render_markdown(report: dict) -> str:
    cfg = report["config"]
    r = report["results"]
    lines = common.header_markdown(
        report, f"Engine benchmark ({cfg['scale']} scale, {cfg['dtype']})")
    lines += [(f"Engine limits: max_num_seqs {cfg['max_num_seqs']}, max_num_batched_tokens "
               f"{cfg['max_num_batched_tokens']}, KV {cfg['kv_cache_memory']}, prefix caching "
               f"{'on' if cfg['prefix_caching'] else 'off'} in the throughput rounds."), ""]

    def row(name, value, target=""):
        lines.append(f"| {name} | {value} | {target} |")

    lines += ["| metric | value | target |", "|---|---|---|"]
    t = r.get("throughput", {})
    if t.get("speedup_median") is not None:
        row("offline output tok/s, engine (median of rounds)", f"{t['engine_median_tok_s']:.1f}")
        row(f"offline output tok/s, transformers batch {t['best_batch_size']} (median)",
            f"{t['transformers_median_tok_s']:.1f}")
        row("engine / transformers (median of per-round ratios)",
            f"{t['speedup_median']:.2f}x", ">= 4x")
        first = t["rounds"][0]["engine"]["result"]
        if first.get("kv_waste") is not None:
            row("KV waste (time-averaged, round 1)", f"{100 * first['kv_waste']:.2f}%", "< 5%")
        row("preemptions (round 1)", first.get("num_preemptions"))
    d = r.get("decode", {})
    if "engine_tok_s" in d:
        row("batch-1 decode tok/s, engine", f"{d['engine_tok_s']:.1f}")
        row("batch-1 decode tok/s, transformers", f"{d['transformers_tok_s']:.1f}")
        row("fraction of bandwidth bound", f"{100 * d['bandwidth_fraction']:.0f}% "
            f"(bound {d['bound_tok_s']:.0f} tok/s: {d['bytes_read_per_token'] / 1e6:.1f} MB "
            f"read per token at {d['copy_bandwidth_bytes_s'] / 1e9:.1f} GB/s copy)")
    p = r.get("prefix", {})
    if "ttft_ratio" in p:
        row("TTFT, 400-token shared prefix, cache off", f"{p['mean_ttft_off_ms']:.0f} ms")
        row("TTFT, cache on", f"{p['mean_ttft_on_ms']:.0f} ms")
        row("TTFT off / on", f"{p['ttft_ratio']:.1f}x", ">= 3x")
    q = r.get("quant", {})
    if "w4a16" in q and "decode_tok_s" in q["w4a16"]:
        for name in ("float32", "bfloat16", "w4a16", "w4a16-bf16"):
            v = q[name]
            row(f"{name}: decode tok/s; RSS now / peak; engine's share",
                f"{v['decode_tok_s']:.1f}; {v['rss_mib']:.0f} / {v['peak_rss_mib']:.0f} MiB; "
                f"{v['rss_of_engine_mib']:.0f} MiB (weights {v['weight_bytes'] / 2**20:.0f} MiB)")
        row("W4A16 / float32 decode speed", f"{q['w4a16_vs_float32_speed']:.2f}x")
    s = r.get("spec", {})
    if "plain" in s:
        row("spec decode (copy task) plain tok/s", f"{s['plain']['tok_s']:.1f}")
        for name in ("ngram-k4", "ngram-k8"):
            row(f"{name} tok/s, speedup, acceptance",
                f"{s[name]['tok_s']:.1f}, {s[f'speedup_{name}']:.2f}x, "
                f"{100 * s[name]['acceptance_rate']:.0f}%")
        row("greedy outputs identical", s["identical_outputs"])
    if "rounds" in t:
        lines += ["", "## Throughput: transformers batch-size sweep (whole workload)", "",
                  f"{t['bracket']}. ({t['limit_note']}.)", "",
                  "| batch | output tok/s | wall s | load before | other procs (cores) |",
                  "|---|---|---|---|---|"]
        for rec in t["transformers_sweep"]:
            res = rec["result"]
            value = (f"{res['output_throughput']:.1f} | {res['wall_s']:.0f}"
                     if "output_throughput" in res else "failed | ")
            lines.append(f"| {rec['name'].rsplit(' ', 1)[-1]} | {value} | "
                         f"{rec['load_before'][0]} | {rec['foreign_cpu_cores']} |")
        lines += ["", "## Throughput: every round (in the order run)", "",
                  ("| round | side | output tok/s | wall s | load before / after | "
                   "other procs (cores) | engine / transformers |"),
                  "|---|---|---|---|---|---|---|"]
        for pair in t["rounds"]:
            for side in pair.get("order", ("engine", "transformers")):
                rec = pair[side]
                res = rec["result"]
                value = (f"{res['output_throughput']:.1f} | {res['wall_s']:.1f}"
                         if "output_throughput" in res else f"error | `{res['error'][-120:]}`")
                ratio = (f"{pair['engine_vs_transformers']:.2f}x"
                         if side == "transformers" and "engine_vs_transformers" in pair else "")
                lines.append(f"| {pair['round']} | {side} | {value} | {rec['load_before'][0]} / "
                             f"{rec['load_after'][0]} | {rec['foreign_cpu_cores']} | {ratio} |")
    parts = [rec for rec in report["rounds"] if rec.get("part") not in
             ("throughput", "throughput-sweep")]
    if parts:
        lines += ["", "| part | load before / after | other procs (cores) | wall s |",
                  "|---|---|---|---|"]
        lines += [f"| {rec['name']} | {rec['load_before'][0]} / {rec['load_after'][0]} | "
                  f"{rec['foreign_cpu_cores']} | {rec['round_wall_s']:.0f} |" for rec in parts]
    errors = {k: v["error"] for k, v in r.items() if isinstance(v, dict) and "error" in v}
    if errors:
        lines += ["", "## Errors", ""] + [f"- {k}: `{v[-400:]}`" for k, v in errors.items()]
    lines += ["", "Raw numbers: the JSON file next to this one."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--scale", choices=sorted(SCALES), default="full")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternating engine / transformers throughput rounds")
    ap.add_argument("--kv-cache-memory", default="3GiB")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--prefix-caching", action="store_true",
                    help="keep prefix caching on in the throughput rounds (each round still "
                         "gets a fresh engine)")
    ap.add_argument("--label", default=None)
    common.add_run_arguments(ap)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        import torch

        cfg = json.loads(args.config)
        torch.set_num_threads(cfg["threads"])
        print(json.dumps(WORKERS[args.worker](cfg), default=str))
        return 0

    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown part(s) {unknown}: choose from {', '.join(PARTS)}")
    cfg = {"model": args.model, "scale": args.scale, "dtype": args.dtype,
           "threads": args.threads, "kv_cache_memory": args.kv_cache_memory,
           "max_num_seqs": args.max_num_seqs,
           "max_num_batched_tokens": args.max_num_batched_tokens,
           "prefix_caching": args.prefix_caching, "rounds": args.rounds, "parts": parts}
    report = common.start_run("engine", cfg, allow_dirty=args.allow_dirty, threads=args.threads,
                              out=args.out_dir)
    results: dict = {}
    rounds: list[dict] = []
    for part in parts:
        print(f"[engine-bench] {part} ...", file=sys.stderr, flush=True)
        if part == "throughput":
            results[part], records = run_throughput(cfg, args.rounds)
            rounds += records
            continue
        record = {"name": part, "part": part}
        with common.measured_round(record, args.threads):
            results[part] = spawn(part, cfg)
        rounds.append(record)
        print(f"[engine-bench] {part} done in {record['round_wall_s']:.0f} s (load "
              f"{record['load_after'][0]}, other processes {record['foreign_cpu_cores']} "
              "cores)", file=sys.stderr, flush=True)
    report["results"] = results
    report["rounds"] = [{k: v for k, v in rec.items() if k != "result"} for rec in rounds
                        if rec.get("part") not in ("throughput", "throughput-sweep")]
    common.finish_run(report, rounds)
    # A run of some parts is named after them, so it never overwrites another's report.
    label = args.label or "-".join([args.scale, args.dtype]
                                   + ([] if set(parts) == set(PARTS) else list(parts)))
    markdown = render_markdown(report)
    common.write_report(Path(args.out_dir), f"engine-bench-{label}", report, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
