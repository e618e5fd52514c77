"""gpt-oss batch-1 decode with its experts held as MXFP4 (read in place by the native
low-bit kernels' E2M1 codebook mode, 0.53 bytes per weight): the engine against the
read-bandwidth bound counted on the bytes a decode step reads, and against llama.cpp on
llmctl's own ``MXFP4_MOE`` GGUF export of the same checkpoint.

The model: a random gpt-oss-shaped checkpoint that fits here, stored as gpt-oss ships
(gpt-oss-20b's widths and experts: hidden 2880, 64 query and 8 KV heads of 64, 32
experts 2880 wide, 4 of them per token, attention sinks, biases, alternating sliding
(128) / full attention, YaRN, the clamped SwiGLU at 7.0) with 4 layers instead of 24 and
SmolLM2's tokenizer and 49k vocabulary instead of o200k's 201k (about 1.7 GB of MXFP4
experts held, 0.2 GB of them read per token). The experts are MXFP4 as in the released
checkpoints: ``mlp.experts.{gate_up,down}_proj_blocks`` ``[E, out, in / 32, 16]`` uint8
(two E2M1 codes a byte, :mod:`llmctl.quant.mxfp4`), ``_scales`` ``[E, out, in / 32]``
E8M0 bytes, ``_bias`` ``[E, out]`` bf16, ``quantization_config: mxfp4``: random codes
(every byte equally likely) under scales 2^-8..2^-6 (values of rms ~0.02); every other
matrix (attention, router, embedding, head) normal with std 0.02 in bf16, biases std
0.02, sinks std 0.5, norms 1. Random router weights spread the tokens over the experts.
The config keeps what llama.cpp's gpt-oss graph computes (SwiGLU 1.702 / 7.0, YaRN
``truncate: true``, betas 32/1), so the export is not refused.

llama.cpp (llama-cpp-python in this venv, its pinned llama.cpp) reads llmctl's
``MXFP4_MOE`` export of that checkpoint: the expert stacks MXFP4 (every value exactly
the checkpoint's, tests/gguf/test_moe_export.py), every other matrix Q8_0 (attention,
router, embedding and head: 1.06 bytes per weight against the engine's bf16 2), biases,
norms and sinks F32. A probe first decodes a few tokens with llama.cpp's default extra
buffer types (weight repacking: AMX, CPU_REPACK); where that fails (on CPUs with AMX the
pinned build repacks the Q8_0 matrices into AMX buffers and dies in the first decode,
the reason llmctl.gguf.llamacpp.extra_buffers_safe turns them off for its own checks),
the rounds run without them (``use_extra_bufts`` off) and the report quotes the error.

Batch-1 decode, greedy, ``DECODE_TOKENS`` tokens after a 48-token prompt (tokens/s from
the first to the last token), ``--threads`` threads on both sides, each round in a fresh
process, the sides alternating (``common.rotation``), every round reported:

- the engine (``dtype="bfloat16"``, quant_backend "kernel"): the script asserts that
  every expert of every layer is a :class:`LowBitLinear` of kind ``fp4`` (the E2M1
  codebook, E8M0 scale bytes, no offsets, no second VNNI copy, the kernel's ``bits``
  argument ``FP4_FORMAT``) holding 0.5 + 1/32 bytes per weight plus its bias, and that
  the warm-up decode called those layers on bf16 activations. Its round measures
  ``read_bandwidth.py``'s read loop over one step's bytes right before and after the
  decode (same process), the bound the higher rate divided by the bytes a decode step
  reads (``decode_bytes.py``: every dense weight once, the routers, ``k`` of each layer's
  ``E`` experts as held (codes, E8M0 scales, biases), the head once, one embedding row),
  cross-checked against the same count from the checkpoint's shapes.
- llama.cpp: the same read loop runs in this (parent) process right before and after
  its child, and its own bound counts the GGUF's tensors the same way (the ``_exps``
  stacks and their biases ``k / E``, ``token_embd`` one row, the rest whole).

    python benchmarks/gpt_oss_mxfp4_perf.py --rounds 3
    python benchmarks/gpt_oss_mxfp4_perf.py --scale small --rounds 1 --out-dir /tmp/fp4
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common
from decode_bytes import bytes_read_per_token, llmctl_model_reads
from family_perf import decode_rate, prompts
from moe_perf import LLAMACPP_WORKER
from read_bandwidth import read_bandwidth

DECODE_TARGET, VS_LLAMACPP_TARGET = 0.70, 1.0
VOCAB = 49152  # the tokenizer's (SmolLM2)
DECODE_TOKENS, PROMPT_TOKENS = 64, 48
E8M0_CENTRE = 127 - 7  # scales 2^-8, 2^-7, 2^-6: random E2M1 codes then have rms ~0.02
SHAPE = dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, head_dim=64,
             num_attention_heads=64, num_key_value_heads=8, num_local_experts=32,
             num_experts_per_tok=4, num_hidden_layers=4, sliding_window=128,
             swiglu_limit=7.0, rms_norm_eps=1e-5, attention_bias=True,
             tie_word_embeddings=False, max_position_embeddings=131072,
             rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                              "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                              "original_max_position_embeddings": 4096})
SMALL = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
             num_hidden_layers=2)
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
# where llama.cpp's default run died of SIGILL: what gdb showed when this was written
AMX_NOTE = (" (under gdb, when this script was written: the faulting instruction is the AMX "
            "`tilezero` in `ggml_backend_amx_mul_mat` on an OpenMP worker thread, after "
            "llama.cpp repacked the file's Q8_0 matrices into its AMX buffer; the BF16 file "
            "of moe_perf.py has no AMX-repacked type)")


def shape_of(scale: str) -> dict:
    shape = dict(SHAPE, **(SMALL if scale == "small" else {}))
    shape["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(shape["num_hidden_layers"])]
    return shape


def build(out: Path, scale: str) -> Path:
    """The checkpoint (module doc): tensor names and shapes from transformers' own
    GptOssForCausalLM (built on the meta device, nothing allocated), the experts written
    as MXFP4 blocks and scales, never materialized in float."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmctl.models.loading import load_tokenizer
    from llmctl.models.resolve import resolve_model
    from llmctl.quant import mxfp4

    config = AutoConfig.for_model(**shape_of(scale), vocab_size=VOCAB, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=2, dtype="bfloat16")
    with torch.device("meta"):
        names = {n: tuple(p.shape) for n, p in
                 AutoModelForCausalLM.from_config(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in names.items():
        if name.endswith(EXPERTS):  # x @ W: [E, in, out] -> [E, out, in / 32, 16] + scales
            e, k_in, n_out = shape
            groups = k_in // mxfp4.BLOCK
            tensors[f"{name}_blocks"] = torch.randint(
                0, 256, (e, n_out, groups, mxfp4.BLOCK // 2), generator=gen, dtype=torch.uint8)
            tensors[f"{name}_scales"] = torch.randint(
                E8M0_CENTRE - 1, E8M0_CENTRE + 2, (e, n_out, groups), generator=gen,
                dtype=torch.uint8)
        elif name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            std = 0.5 if name.endswith("sinks") else 0.02
            tensors[name] = torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, std,
                                                                             generator=gen)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = ["GptOssForCausalLM"]
    config_dict = config.to_dict()
    config_dict["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config_dict, indent=2))
    load_tokenizer(Path(resolve_model("smollm2-135m").path)).save_pretrained(str(out))
    return out


def checkpoint_bytes(shape: dict) -> dict:
    """What one batch-1 decode step reads, counted from the checkpoint's shapes at the
    engine's held dtypes (bf16 dense weights, biases and norms; sinks float32; experts as
    E2M1 nibbles + an E8M0 byte per 32 + their bf16 biases): a cross-check of the
    loaded model's count."""
    h, d, layers = shape["hidden_size"], shape["head_dim"], shape["num_hidden_layers"]
    inter, e, k = shape["intermediate_size"], shape["num_local_experts"], \
        shape["num_experts_per_tok"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    bf16 = 2
    expert_weights = 2 * inter * h + h * inter
    per_expert = expert_weights // 2 + expert_weights // 32 + (2 * inter + h) * bf16
    parts = {
        "experts (k of E: E2M1 codes, E8M0 scales, biases)": layers * k * per_expert,
        "attention (qkv, o, biases, sinks)": layers * ((h * (q + 2 * kv) + q * h) * bf16
                                                       + (q + 2 * kv + h) * bf16
                                                       + shape["num_attention_heads"] * 4),
        "routers (weight, bias)": layers * (e * h + e) * bf16,
        "norms": (2 * layers + 1) * h * bf16,
        "head": VOCAB * h * bf16,
        "embedding row": h * bf16,
    }
    return {"parts": parts, "total": sum(parts.values()),
            "experts_held": layers * e * per_expert}


def gguf_bytes(path: Path, shape: dict) -> dict:
    """The bytes llama.cpp's decode step reads from the GGUF, counted as for the engine:
    the expert stacks (``*_exps.*``, weights and biases) ``k / E`` of them, token_embd one
    row, every other tensor whole; and the types of the tensors."""
    import gguf
    import numpy as np

    k, e = shape["num_experts_per_tok"], shape["num_local_experts"]
    parts = {"experts (k of E)": 0, "token_embd (one row)": 0, "output": 0, "rest": 0}
    types: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        kind = t.tensor_type.name
        key = re.sub(r"^blk\.\d+\.", "blk.N.", t.name)
        types[f"{key}: {kind}"] = types.get(f"{key}: {kind}", 0) + 1
        if "_exps" in t.name:
            assert int(t.n_bytes) * k % e == 0, t.name
            parts["experts (k of E)"] += int(t.n_bytes) * k // e
        elif t.name == "token_embd.weight":
            parts["token_embd (one row)"] += int(t.n_bytes) // int(np.prod(t.shape[1:]))
        elif t.name == "output.weight":
            parts["output"] += int(t.n_bytes)
        else:
            parts["rest"] += int(t.n_bytes)
    return {"parts": parts, "total": sum(parts.values()), "tensor_types": types}


# --- the engine's round ------------------------------------------------------------------
def expert_layers(model) -> dict:
    """Assert that every expert of every layer runs on the E2M1 codebook kernel (module
    doc); returns what was checked."""
    import torch

    from llmctl.quant import mxfp4
    from llmctl.serve.layers.lowbit import FP4_FORMAT, LowBitLinear, simd_available

    kinds, experts = {}, []
    for i, layer in enumerate(model.layers):
        moe = layer.moe
        assert moe is not None, f"layer {i} has no mixture of experts"
        assert moe.gate_up_bias is None and moe.down_bias is None, "biases outside the experts"
        for part in (moe.gate_up, moe.down):
            assert isinstance(part, list), f"layer {i}: stacked experts ({type(part)})"
            for lin in part:
                assert isinstance(lin, LowBitLinear), f"layer {i}: {type(lin).__name__}"
                assert lin.kind == "fp4" and lin.codebook == mxfp4.FP4_TIMES_2
                assert lin.zeros is None and lin.vnni_codes is None and lin.vnni_rows == 0
                assert lin.scales.dtype == torch.uint8
                assert lin._wide[1][1] == FP4_FORMAT  # the kernel's bits argument
                weights = lin.out_features * lin.in_features
                assert lin.packed.numel() * lin.packed.element_size() == weights // 2
                assert lin.scales.numel() == weights // mxfp4.BLOCK
                kinds[lin.kind] = kinds.get(lin.kind, 0) + 1
                experts.append(lin)
    first = experts[0]
    return {"expert_linears": kinds, "experts": experts,
            "kernel_body": "avx2" if first.avx2 else
            ("avx512-bf16" if simd_available() else "scalar"),
            "bytes_per_weight": sum(x.packed.numel() + x.scales.numel() for x in experts)
            / sum(x.out_features * x.in_features for x in experts)}


def spied_warmup(llm, prompt: list[int], experts: list) -> dict:
    """The warm-up decode with every call of an expert linear recorded (kind, activation
    dtype, rows): the class's ``__call__`` wrapped for the warm-up only, never during
    the measured decode."""
    from llmctl.serve.layers.lowbit import LowBitLinear

    ids, seen = {id(x) for x in experts}, {}
    original = LowBitLinear.__call__

    def spy(self, x):
        if id(self) in ids:
            key = f"{self.kind} {str(x.dtype).removeprefix('torch.')} rows={x.shape[0]}"
            seen[key] = seen.get(key, 0) + 1
        return original(self, x)

    LowBitLinear.__call__ = spy
    try:
        decode_rate(llm, prompt, 8)
    finally:
        LowBitLinear.__call__ = original
    return seen


def engine_worker(cfg: dict) -> dict:
    import torch

    from llmctl.serve.engine.llm import LLM
    from llmctl.serve.kernels.cpu import selected_variant

    prompt = cfg["prompt"]
    start = time.perf_counter()
    llm = LLM(cfg["model"], dtype="bfloat16", kv_cache_memory="128MiB", max_num_seqs=1,
              max_model_len=len(prompt) + cfg["n"] + 8)
    load_s = time.perf_counter() - start
    model = llm.engine.target.model
    checked = expert_layers(model)
    calls = spied_warmup(llm, prompt, checked.pop("experts"))  # also the warm-up
    decode_calls = sum(n for key, n in calls.items() if key.endswith("rows=1"))
    shape = cfg["shape"]
    # 7 decode steps after the prefill's step, each: k experts x (gate_up, down) x layers
    assert decode_calls >= 7 * 2 * shape["num_experts_per_tok"] * shape["num_hidden_layers"]
    assert all(key.startswith("fp4 bfloat16") for key in calls), calls
    read = bytes_read_per_token(llmctl_model_reads(model))
    mib = -(-int(read) // 2**20)
    before = read_bandwidth(mib)
    rate = decode_rate(llm, prompt, cfg["n"])
    after = read_bandwidth(mib)
    bound = max(before, after)
    attn = model.layers[0].qkv
    return {"tok_s": rate, "bytes_read_per_token": read, "read_bandwidth_bytes_s": bound,
            "read_bandwidth_before_after": [before, after],
            "fraction": read * rate / bound, "bytes_held": model.nbytes,
            "bytes_read_per_step_model": model.bytes_read_per_step, "load_s": load_s,
            "dtype": str(model.embed.dtype).removeprefix("torch."),
            "attention_linear": f"{type(attn).__name__} "
                                f"{getattr(attn, 'weight', model.embed).dtype!s}",
            "kernel_variant": selected_variant(), "torch_threads": torch.get_num_threads(),
            "expert_calls_in_warmup": calls, **checked}


# llama.cpp's worker is moe_perf's, run after this: it sets ``use_extra_bufts`` (the
# weight-repacking buffer types, AMX among them) as the parent decided (main), through
# llmctl's own switch (llmctl.gguf.llamacpp), its context held for the process's life
LLAMACPP_PREFIX = r"""
import json as _json, sys as _sys
from llmctl.gguf.llamacpp import _model_defaults
_extra_bufts = _model_defaults(_json.loads(_sys.argv[1])["use_extra_bufts"])
_extra_bufts.__enter__()
"""


def spawn(side: str, cfg: dict, threads: int) -> dict:
    env = common.thread_env(threads)
    env["PYTHONPATH"] = ":".join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = ([sys.executable, "-c", LLAMACPP_PREFIX + LLAMACPP_WORKER, json.dumps(cfg)]
           if side == "llama.cpp" else [sys.executable, __file__, "--worker", json.dumps(cfg)])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        rc = proc.returncode
        how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
        raise RuntimeError(f"{side} failed ({how}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def llamacpp_probe(gguf: Path, threads: int) -> dict:
    """Whether llama.cpp decodes the file with its default extra buffer types (AMX repacks
    Q8_0 on a CPU with AMX) and, where not, without them (``use_extra_bufts`` off, as
    llmctl.gguf.llamacpp.extra_buffers_safe decides for its own checks): the setting the
    rounds use, and each try's error."""
    tries = {}
    for extra in (True, False):
        cfg = {"mode": "batch1", "prompt": [1, 2, 3, 4, 5], "n": 3, "threads": threads,
               "gguf": str(gguf), "use_extra_bufts": extra}
        try:
            spawn("llama.cpp", cfg, threads)
            return {"use_extra_bufts": extra, "errors": tries}
        except RuntimeError as err:
            text = str(err)
            tail = [line for line in text.splitlines() if line.strip()][-4:]
            tries[f"use_extra_bufts={extra}"] = " | ".join(tail)
            print(f"  llama.cpp with use_extra_bufts={extra}: {tries[f'use_extra_bufts={extra}']}",
                  file=sys.stderr, flush=True)
    return {"use_extra_bufts": None, "errors": tries}


def run(model: Path, gguf: Path, shape: dict, llama_bytes: int | None,
        extra_bufts: bool | None, rounds: int, threads: int) -> list[dict]:
    prompt = (prompts(1)[0] * 4)[:PROMPT_TOKENS]
    base = {"mode": "batch1", "prompt": prompt, "n": DECODE_TOKENS, "threads": threads,
            "model": str(model), "gguf": str(gguf), "shape": shape,
            "use_extra_bufts": extra_bufts}
    sides = ["engine"] + (["llama.cpp"] if llama_bytes is not None else [])
    mib = None if llama_bytes is None else -(-llama_bytes // 2**20)
    records = []
    for rnd in range(1, rounds + 1):
        for side in common.rotation(sides, rnd):
            record = {"name": f"{side} round {rnd}", "side": side, "round": rnd}
            if side == "llama.cpp":  # its bound: the same read loop, here, around its child
                before = read_bandwidth(mib, threads=threads)
            with common.measured_round(record, threads):
                record.update(spawn(side, base, threads))
            if side == "llama.cpp":
                after = read_bandwidth(mib, threads=threads)
                bound = max(before, after)
                record.update(bytes_read_per_token=llama_bytes, read_bandwidth_bytes_s=bound,
                              read_bandwidth_before_after=[before, after],
                              fraction=llama_bytes * record["tok_s"] / bound)
            records.append(record)
            print(f"  {record['name']}: {record['tok_s']:.2f} tok/s, {record['fraction']:.0%} "
                  f"of its bound", file=sys.stderr, flush=True)
    return records


def summary(records: list[dict]) -> dict:
    def med(side, key):
        return common.median([r[key] for r in records if r["side"] == side])

    out = {"engine_tok_s_median": med("engine", "tok_s"),
           "engine_fraction_median": med("engine", "fraction"),
           "engine_bound_tok_s_median": common.median(
               [r["read_bandwidth_bytes_s"] / r["bytes_read_per_token"] for r in records
                if r["side"] == "engine"])}
    if any(r["side"] == "llama.cpp" for r in records):
        ratios = []
        for rnd in sorted({r["round"] for r in records}):
            pair = {r["side"]: r for r in records if r["round"] == rnd}
            ratios.append(pair["engine"]["tok_s"] / pair["llama.cpp"]["tok_s"])
        out.update(llamacpp_tok_s_median=med("llama.cpp", "tok_s"),
                   llamacpp_fraction_median=med("llama.cpp", "fraction"),
                   engine_vs_llamacpp_median=common.median(ratios),
                   engine_vs_llamacpp_min=min(ratios), ratios=ratios)
    return out


def markdown(report: dict) -> str:
    s = report["summary"]
    eng = next(r for r in report["rounds"] if r["side"] == "engine")
    counted, llama = report["checkpoint_bytes"], report["gguf_bytes"]
    ran, probe = "llamacpp_error" not in report, report["llamacpp_probe"]
    lines = common.header_markdown(report, "gpt-oss decode with MXFP4 experts (codebook "
                                           "kernel) against the bound and llama.cpp")
    lines += [(f"Model: {json.dumps(report['config']['shape'])}, vocab {VOCAB}; random "
               "weights, experts stored as MXFP4 `_blocks`/`_scales` (gpt-oss's layout). "
               f"Built in {report['build_s']:.0f} s, exported to GGUF in "
               f"{report['export_s']:.0f} s."), "",
              (f"Engine: dtype {eng['dtype']} (bf16 activations: the CPU has AVX512-BF16 = "
               f"{report['metadata']['machine']['cpu_flags'].get('avx512_bf16')}), kernels "
               f"`{eng['kernel_variant']}`, dense layers {eng['attention_linear']}. "
               f"MXFP4 codebook path asserted in every engine round: "
               f"{eng['expert_linears']} expert linears (gate_up and down of each expert of "
               f"each layer) are `LowBitLinear` kind fp4 (E2M1 table, E8M0 scale bytes, no "
               f"offsets, no VNNI copy, kernel bits argument FP4_FORMAT) on the "
               f"{eng['kernel_body']} body, {eng['bytes_per_weight']:.4f} bytes per weight; "
               f"the warm-up decode called them as {eng['expert_calls_in_warmup']}."), "",
              (f"Held by the engine {eng['bytes_held'] / 1e9:.2f} GB (experts "
               f"{counted['experts_held'] / 1e9:.2f} GB). Bytes a decode step reads: engine "
               f"{eng['bytes_read_per_token'] / 1e6:.1f} MB (`decode_bytes.py` on the loaded "
               f"model; from the checkpoint's shapes {counted['total'] / 1e6:.1f} MB; "
               f"`LlamaModel.bytes_read_per_step`, no embedding row: "
               f"{eng['bytes_read_per_step_model'] / 1e6:.1f} MB):"), ""]
    lines += [f"- {name}: {n / 1e6:.1f} MB" for name, n in counted["parts"].items()]
    lines += ["", (f"llama.cpp reads {llama['total'] / 1e6:.1f} MB per step from the "
                   "MXFP4_MOE file (" + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in
                                                 llama["parts"].items())
                   + f"); tensor types: {json.dumps(llama['tensor_types'])}.")]
    if not ran:
        lines += ["", f"**llama.cpp did not run the export**: {report['llamacpp_error']}"]
    elif probe["errors"]:
        sigill = any("SIGILL" in v for v in probe["errors"].values())
        lines += ["", ("**llama.cpp with its default extra buffer types could not decode the "
                       "export**: " + "; ".join(f"{k}: `{v}`" for k, v in probe["errors"].items())
                       + (AMX_NOTE if sigill else "")
                       + f". The rounds run it with use_extra_bufts={probe['use_extra_bufts']} "
                       "(no AMX / CPU_REPACK weight repacking: the plain CPU kernels, as "
                       "llmctl's own llama.cpp checks run on this CPU).")]
    else:
        lines += ["", "llama.cpp ran with its default extra buffer types (use_extra_bufts=True)."]
    lines += ["", "| measure | engine | llama.cpp | engine / llama.cpp (median; min) |",
              "|---|---|---|---|",
              (f"| batch-1 decode tok/s (median) | {s['engine_tok_s_median']:.2f} | "
               + (f"{s['llamacpp_tok_s_median']:.2f} | {s['engine_vs_llamacpp_median']:.2f}x; "
                  f"{s['engine_vs_llamacpp_min']:.2f}x |" if ran else "- | - |")),
              (f"| of its own read-bandwidth bound (median) | {s['engine_fraction_median']:.0%}"
               f" (target >= {DECODE_TARGET:.0%}) | "
               + (f"{s['llamacpp_fraction_median']:.0%} | |" if ran else "- | |")),
              "", "Every round (each in its own process):", "",
              ("| round | tok/s | bytes / step (MB) | of the bound | read bandwidth (GB/s) | "
               "load before / after | other procs (cores) |"), "|---|---|---|---|---|---|---|"]
    for r in report["rounds"]:
        lines.append(f"| {r['name']} | {r['tok_s']:.2f} | {r['bytes_read_per_token'] / 1e6:.1f}"
                     f" | {r['fraction']:.0%} | {r['read_bandwidth_bytes_s'] / 1e9:.1f} | "
                     f"{r['load_before'][0]} / {r['load_after'][0]} | "
                     f"{r['foreign_cpu_cores']} |")
    lines += ["", ("Bound of a round: `read_bandwidth.py`'s read loop over one step's bytes "
                   "(best of 5), right before and after the decode (the engine: in its "
                   "process; llama.cpp: in the parent around its child), the higher, divided "
                   "by that side's bytes per step.")]
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
        print(json.dumps(engine_worker(cfg), default=str))
        return 0
    import torch

    torch.set_num_threads(args.threads)
    shape = shape_of(args.scale)
    report = common.start_run("gpt-oss-mxfp4-perf",
                              {"rounds": args.rounds, "scale": args.scale, "shape": shape,
                               "vocab": VOCAB, "decode_tokens": DECODE_TOKENS,
                               "prompt_tokens": PROMPT_TOKENS, "e8m0_centre": E8M0_CENTRE},
                              allow_dirty=args.allow_dirty, threads=args.threads,
                              out=Path(args.out_dir))
    from llmctl.gguf.export import quantize_to_gguf

    report["checkpoint_bytes"] = checkpoint_bytes(shape)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        model = build(Path(tmp) / "model", args.scale)
        report["build_s"] = time.perf_counter() - start
        start = time.perf_counter()
        gguf = Path(quantize_to_gguf(model, Path(tmp) / "model-mxfp4_moe.gguf", "MXFP4_MOE",
                                     threads=args.threads)["path"])
        report["export_s"] = time.perf_counter() - start
        print(f"built in {report['build_s']:.0f} s, exported in {report['export_s']:.0f} s",
              file=sys.stderr, flush=True)
        report["gguf_bytes"] = gguf_bytes(gguf, shape)
        llama_bytes = report["gguf_bytes"]["total"]
        report["llamacpp_probe"] = probe = llamacpp_probe(gguf, args.threads)
        if probe["use_extra_bufts"] is None:  # the engine alone, llama.cpp's errors reported
            report["llamacpp_error"] = "; ".join(f"{k}: {v}" for k, v in probe["errors"].items())
            llama_bytes = None
        report["rounds"] = run(model, gguf, shape, llama_bytes, probe["use_extra_bufts"],
                               args.rounds, args.threads)
    report["summary"] = summary(report["rounds"])
    common.finish_run(report, report["rounds"])
    print(common.write_report(Path(args.out_dir), "gpt-oss-mxfp4-perf", report,
                              markdown(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
