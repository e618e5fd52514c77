"""SmolLM2 GGUF quant table: size, bits/weight, perplexity and KL divergence per type.

Every type is exported by ``llmctl.gguf.export.quantize_to_gguf`` from the float32
checkpoint, run by llama.cpp (llama-cpp-python), and compared position by position
with transformers' float32 logits on held-out text (``builtin:pydoc-heldout``, never
seen by the imatrix calibration text ``builtin:pydoc-calib``). Output in the shape of
llama.cpp's published quant table (tools/quantize/README.md): one column per type,
one row per measure.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/gguf_quant_table.py \
        --windows 4 --seq-len 512 --threads 2

writes results/gguf-quant-table.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import common

from llmctl.utils.atomic import write_text

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# (label, file type, use an imatrix): the order of the table's columns.
TYPES = [
    ("F16", "F16", False),
    ("Q8_0", "Q8_0", False),
    ("Q6_K", "Q6_K", False),
    ("Q5_K_M", "Q5_K_M", False),
    ("Q5_1", "Q5_1", False),
    ("Q5_0", "Q5_0", False),
    ("Q4_K_M", "Q4_K_M", False),
    ("Q4_K_M+imatrix", "Q4_K_M", True),
    ("IQ4_XS+imatrix", "IQ4_XS", True),
    ("Q4_0", "Q4_0", False),
    ("Q3_K_M", "Q3_K_M", False),
    ("Q2_K+imatrix", "Q2_K", True),
]


def _speed(path: Path, threads: int, prompt: list[int], gen: int) -> dict:
    """One prompt-processing pass and one greedy run (single samples: indicative)."""
    from llmctl.gguf.llamacpp import LlamaCppModel

    with LlamaCppModel(path, n_ctx=len(prompt) + gen + 1, threads=threads) as model:
        t = time.perf_counter()
        model.logits(prompt)
        pp = len(prompt) / (time.perf_counter() - t)
        t = time.perf_counter()
        out = model.greedy(prompt[:16], gen)
        tg = len(out) / (time.perf_counter() - t)
    return {"pp_tokens_per_s": pp, "tg_tokens_per_s": tg}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--imatrix-samples", type=int, default=32)
    parser.add_argument("--types", default=",".join(t[0] for t in TYPES))
    parser.add_argument("--out", default=str(REPO / "results" / "gguf-quant-table"))
    parser.add_argument("--allow-dirty", action="store_true",
                        help="write results/ from an uncommitted tree anyway")
    args = parser.parse_args()
    common.refuse_dirty(common.tree_state(), args.allow_dirty, args.out)

    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    from llmctl.eval.metrics import PositionStats, comparison_summary, dense_position_stats
    from llmctl.gguf import imatrix as im
    from llmctl.gguf.compare import heldout_windows, llamacpp_logits, transformers_logits
    from llmctl.gguf.export import quantize_to_gguf
    from llmctl.models.resolve import resolve_model
    from llmctl.report import run_metadata

    command = "OMP_WAIT_POLICY=" + os.environ.get("OMP_WAIT_POLICY", "") + " " + \
        " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv])
    meta_start = run_metadata()
    model_dir = resolve_model(args.model).path
    windows = heldout_windows(model_dir, seq_len=args.seq_len, count=args.windows)
    t = time.perf_counter()
    reference = transformers_logits(model_dir, windows)
    ref_seconds = time.perf_counter() - t
    wanted = args.types.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="gguf-table-") as tmp:
        tmp = Path(tmp)
        imatrix_file = None
        if any(use for label, _, use in TYPES if label in wanted):
            t = time.perf_counter()
            matrix = im.compute_imatrix(model_dir, "builtin:pydoc-calib",
                                        samples=args.imatrix_samples, seq_len=512)
            imatrix_file = im.save_imatrix(matrix, tmp / "imatrix.gguf")
            imatrix_seconds = time.perf_counter() - t
        for label, gguf_type, use_imatrix in TYPES:
            if label not in wanted:
                continue
            out = tmp / f"{label}.gguf"
            summary = quantize_to_gguf(model_dir, out, gguf_type,
                                       imatrix=imatrix_file if use_imatrix else None,
                                       threads=args.threads)
            t = time.perf_counter()
            logits = llamacpp_logits(out, windows, threads=args.threads)
            stats = comparison_summary(PositionStats.concat([
                dense_position_stats(r[:-1], c[:-1], np.asarray(w[1:]))
                for r, c, w in zip(reference, logits, windows)]))
            del logits
            row = {
                "label": label, "type": gguf_type, "imatrix": use_imatrix,
                "engine": summary["engine"], "size_bytes": summary["size"],
                "bits_per_weight": summary["bits_per_weight"], "types": summary["types"],
                "fallbacks": len(summary["fallbacks"]), "export_seconds": summary["seconds"],
                "eval_seconds": time.perf_counter() - t, **stats,
                **_speed(out, args.threads, windows[0], 64),
            }
            rows.append(row)
            print(f"{label:>16}  {row['bits_per_weight']:5.2f} bpw  PPL {row['ppl']:.4f}  "
                  f"KLD {row['mean_kld']:.5f}  top1 {row['same_top_p']:.3f}", flush=True)
            out.unlink()
    result = {
        "benchmark": "gguf-quant-table",
        "command": command,
        "model": args.model,
        "model_path": str(model_dir),
        "data": {"source": "builtin:pydoc-heldout", "windows": len(windows),
                 "seq_len": args.seq_len,
                 "tokens_scored": rows[0]["tokens_scored"] if rows else 0},
        "imatrix": {"source": "builtin:pydoc-calib", "samples": args.imatrix_samples,
                    "seq_len": 512, "seconds": imatrix_seconds if imatrix_file else None},
        "reference": {"engine": "transformers float32", "ppl": rows[0]["ref_ppl"]
                      if rows else None, "seconds": ref_seconds},
        "threads": args.threads,
        "metadata_start": meta_start,
        "metadata": run_metadata(llama_cpp_python=_llama_version()),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text(out.with_suffix(".json"), json.dumps(result, indent=2))
    write_text(out.with_suffix(".md"), render_markdown(result))
    print(f"wrote {out.with_suffix('.md')}")
    return 0


def _llama_version() -> str | None:
    from llmctl.gguf.llamacpp import version

    return version()


def render_markdown(result: dict) -> str:
    rows = result["rows"]
    ref_ppl = result["reference"]["ppl"]
    measures = [
        ("bits/weight", lambda r: f"{r['bits_per_weight']:.4f}"),
        ("size (MiB)", lambda r: f"{r['size_bytes'] / 2**20:.1f}"),
        ("perplexity", lambda r: f"{r['ppl']:.4f}"),
        ("ΔPPL vs float", lambda r: f"{r['ppl'] - ref_ppl:+.4f}"),
        ("mean KLD", lambda r: f"{r['mean_kld']:.6f}"),
        ("99% KLD", lambda r: f"{r['p99_kld']:.5f}"),
        ("same top token", lambda r: f"{100 * r['same_top_p']:.2f}%"),
        ("fallback tensors", lambda r: str(r["fallbacks"])),
        ("written by", lambda r: r["engine"]),
        ("prompt processing t/s @ 512", lambda r: f"{r['pp_tokens_per_s']:.0f}"),
        ("text generation t/s @ 64", lambda r: f"{r['tg_tokens_per_s']:.0f}"),
    ]
    meta = result["metadata"]
    load = meta["machine"].get("load_average")
    lines = [
        "# GGUF quant table: SmolLM2-135M-Instruct",
        "",
        f"Command: `{result['command']}`",
        "",
        (f"Reference: transformers float32, perplexity {ref_ppl:.4f} on "
        f"{result['data']['tokens_scored']} held-out tokens ({result['data']['windows']} windows "
        f"of {result['data']['seq_len']} from `{result['data']['source']}`). KLD = "
        "KL(float || GGUF) per position, llama.cpp logits vs transformers logits."),
        (f"imatrix: {result['imatrix']['samples']} x {result['imatrix']['seq_len']} tokens of "
        f"`{result['imatrix']['source']}` (disjoint from the evaluation text)."),
        (f"Machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores, threads "
        f"{result['threads']}, load average at start "
        f"{result['metadata_start']['machine'].get('load_average')}, at end {load}. "
        f"llama-cpp-python {meta.get('llama_cpp_python')}, commit {meta['llmctl_commit']}."),
        "",
        ("SmolLM2's rows are 576 wide, not a multiple of 256: K-quant and i-quant types fall "
        "back to 32-wide blocks (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL) on "
        "every tensor but ffn_down (1536 wide); the 'fallback tensors' row counts them."),
        "",
        ("The 'float' reference is the embedded SmolLM2, itself dequantized from a Q4_1 GGUF: "
         "its weights sit on Q4_1's 16-level grid, which other 32-blocks likely re-round with "
         "structured rather than random errors (a hypothesis, not verified). Measured consequence: Q5_1 lands behind "
         "Q5_0, and so Q5_K_M (whose fallback is Q5_1) behind Q4_K_M (fallback Q5_0). With "
         "256-wide rows (tests/gguf/test_kquants.py) the usual order Q8_0 < Q6_K < Q5_K_M < "
         "Q4_K_M < Q4_0 holds."),
        "",
        ("Speed rows are single runs on a shared, loaded machine, in a process that also "
         "holds torch (whose OpenMP pool slowed llama.cpp's 2-thread decode several-fold): "
         "indicative only, not llama.cpp's speed."),
        "",
    ]
    for start in range(0, len(rows), 6):
        chunk = rows[start:start + 6]
        lines.append("| Measure | " + " | ".join(r["label"] for r in chunk) + " |")
        lines.append("| --- | " + " | ".join("---:" for _ in chunk) + " |")
        for name, fmt in measures:
            lines.append(f"| {name} | " + " | ".join(fmt(r) for r in chunk) + " |")
        lines.append("")
    lines.append("Tensor types per file:")
    lines.append("")
    for r in rows:
        types = ", ".join(f"{k} x{v}" for k, v in r["types"].items())
        lines.append(f"- {r['label']}: {types}")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
