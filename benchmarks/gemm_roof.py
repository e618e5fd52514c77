"""bf16 matrix products of a decode step against this machine's roofs: llmctl's own
kernel (``csrc/gemm_bf16.cpp``) and oneDNN's packed GEMM on SmolLM2's layer shapes.

For each row count (1 .. 2048: batch-1 decode to a prefill chunk) the 30 decoder layers'
four products (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) run back to back
on 30 distinct random weights per shape, as a decode step meets them: every weight cold
(212 MB of bf16, far beyond the caches). Reported per side: milliseconds for all of them,
the achieved GFLOP/s (2 x rows x parameters) and GB/s of weights (212 MB / time), against

- the compute roof: the faster of a warm 2048^3 bf16 ``torch.matmul`` (oneDNN) and the
  own kernel on a warm (L2-resident) 576 x 576 weight times 512 rows: what this CPU's
  bf16 dot-product units reach here with the weights in cache;
- the bandwidth roof: a ``torch.sum`` over 512 MiB of bf16 (read bandwidth).

Both roofs are measured by :mod:`llmctl.hw.probe` (the code of ``llmctl hw probe``,
whose peaks are the best run where these are medians) before the rounds, between rounds
and after them (this VM's memory bandwidth moves by a third from minute to minute); the
fractions use their medians, and every measurement is in the JSON.

Sides alternate (own first in odd rounds); per row count the median over rounds, and
every round in the JSON. Threads: ``--threads`` for both (torch's pool; the kernel
uses the same OpenMP runtime).

    python benchmarks/gemm_roof.py --rounds 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2-135M, q/k/v fused
LAYERS = 30
ROWS = (1, 4, 8, 16, 32, 64, 128, 512, 2048)
REPEATS = 5  # timed passes per side and round; the median is kept


def roofs() -> dict:
    """The compute and bandwidth roofs, measured by llmctl's probe (``llmctl hw probe``):
    medians of 7 runs after a warm-up."""
    from llmctl.hw.probe import own_gemm_bf16, read_bandwidth, torch_matmul

    onednn = torch_matmul("bf16", 2048, 7).median / 1e9
    own_peak = own_gemm_bf16(20, 7).median / 1e9
    bandwidth = read_bandwidth(512 * 1024 * 1024, 7).median / 1e9  # 512 MiB of bf16
    return {"onednn_matmul_gflops": round(onednn, 1), "own_warm_gflops": round(own_peak, 1),
            "bf16_gflops": round(max(onednn, own_peak), 1), "read_gbps": round(bandwidth, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    common.add_run_arguments(ap)
    args = ap.parse_args(argv)
    import torch

    from llmctl.hw.probe import median_seconds
    from llmctl.serve.layers.quant_linear import PackedLinear, bf16_gemm_layer

    torch.set_num_threads(args.threads)
    out_dir = Path(args.out_dir)
    rows_list = [int(r) for r in args.rows.split(",")]
    report = common.start_run("gemm-roof", {"rounds": args.rounds, "shapes": SHAPES,
                                            "layers": LAYERS, "rows": rows_list},
                              allow_dirty=args.allow_dirty, threads=args.threads, out=out_dir)
    if bf16_gemm_layer(torch.zeros(32, 32, dtype=torch.bfloat16)) is None:
        raise SystemExit("this CPU has no AVX512-BF16: llmctl's own bf16 kernel is not built")
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen).bfloat16() * 0.02 for n, k in SHAPES]
               for _ in range(LAYERS)]
    sides = {"own": [[PackedLinear(w, None, gemm="own") for w in layer] for layer in weights],
             "onednn": [[PackedLinear(w, None, gemm="onednn") for w in layer]
                        for layer in weights]}
    del weights
    params = LAYERS * sum(n * k for n, k in SHAPES)
    report["roofs"] = [roofs()]
    records = []
    for rnd in range(1, args.rounds + 1):
        if rnd > 1:
            report["roofs"].append(roofs())
        order = ("own", "onednn") if rnd % 2 else ("onednn", "own")
        for rows in rows_list:
            xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for _, k in SHAPES}
            for side in order:
                layers = sides[side]

                def step(layers=layers, xs=xs) -> None:
                    for layer in layers:
                        for lin, (_, k) in zip(layer, SHAPES):
                            lin(xs[k])

                record = {"name": f"{side} {rows} rows round {rnd}", "side": side,
                          "rows": rows, "round": rnd}
                with common.measured_round(record, args.threads):
                    seconds = median_seconds(step, REPEATS if rows < 512 else 3)
                record.update(ms=round(seconds * 1e3, 2),
                              gflops=round(2 * rows * params / seconds / 1e9, 1),
                              weight_gbps=round(2 * params / seconds / 1e9, 1))
                records.append(record)
                print(f"{record['name']}: {record['ms']} ms, {record['gflops']} GFLOP/s",
                      file=sys.stderr, flush=True)
    report["roofs"].append(roofs())
    report["roof_bf16_gflops"] = common.median([r["bf16_gflops"] for r in report["roofs"]])
    report["roof_read_gbps"] = common.median([r["read_gbps"] for r in report["roofs"]])
    report["rounds"] = records
    summary = []
    for rows in rows_list:
        med = {side: common.median([r["ms"] for r in records
                                    if r["rows"] == rows and r["side"] == side])
               for side in sides}
        summary.append({"rows": rows, **{f"{s}_ms": m for s, m in med.items()},
                        **{f"{s}_gflops": round(2 * rows * params / (m / 1e3) / 1e9, 1)
                           for s, m in med.items()},
                        "own_over_onednn_time": round(med["own"] / med["onednn"], 3)})
    report["summary"] = summary
    common.finish_run(report, records)
    path = common.write_report(out_dir, "gemm-roof-smollm2", report, markdown(report, params))
    print(path)
    return 0


def markdown(report: dict, params: int) -> str:
    lines = common.header_markdown(report, "bf16 matrix products of SmolLM2's decoder layers: "
                                           "own kernel vs oneDNN, against the roofs")
    peak, bw = report["roof_bf16_gflops"], report["roof_read_gbps"]
    measured = report["roofs"]
    compute = " / ".join(str(r["bf16_gflops"]) for r in measured)
    read = " / ".join(str(r["read_gbps"]) for r in measured)
    lines += [(f"{LAYERS} layers x 4 products ({', '.join(f'{n}x{k}' for n, k in SHAPES)}), "
               f"{params * 2 / 1e6:.0f} MB of bf16 weights, all cold; median of "
               f"{len({r['round'] for r in report['rounds']})} alternating rounds."),
              ("Roofs, measured before, between and after the rounds: bf16 compute (the "
               "faster of oneDNN's warm 2048^3 matmul and the own kernel on a warm weight) "
               f"{compute} GFLOP/s; read bandwidth (torch.sum, 512 MiB) {read} GB/s. The "
               f"fractions below use the medians ({peak} GFLOP/s, {bw} GB/s)."), "",
              ("| rows | own ms | oneDNN ms | own / oneDNN time | own GFLOP/s (of roof) | "
               "oneDNN GFLOP/s (of roof) | own weight GB/s (of read bandwidth) |"),
              "|---|---|---|---|---|---|---|"]
    for s in report["summary"]:
        own_gbps = 2 * params / (s["own_ms"] / 1e3) / 1e9
        lines.append(f"| {s['rows']} | {s['own_ms']} | {s['onednn_ms']} | "
                     f"{s['own_over_onednn_time']:.2f} | {s['own_gflops']} "
                     f"({s['own_gflops'] / peak:.0%}) | {s['onednn_gflops']} "
                     f"({s['onednn_gflops'] / peak:.0%}) | {own_gbps:.1f} ({own_gbps / bw:.0%}) |")
    lines += ["", "Every round: the JSON file next to this one.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
