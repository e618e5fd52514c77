"""llmctl's legacy block quantizers vs gguf-py's reference: same bytes, how fast.

Quantizes one SmolLM2-sized matrix (49152 x 576, the token embedding's shape; random
normal data so the script needs no model) with ``gguf.quants.quantize`` and with
``llmctl.gguf.quants.quantize`` on 1 and 2 threads, best of ``--repeat`` runs, in the
same process, and checks the bytes are identical.

    .venv/bin/python benchmarks/gguf_legacy_quant_speed.py --repeat 3

writes results/gguf-legacy-quant-speed.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import common

from llmctl.utils.atomic import write_text

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=49152)
    parser.add_argument("--cols", type=int, default=576)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "results" / "gguf-legacy-quant-speed"))
    parser.add_argument("--allow-dirty", action="store_true",
                        help="write results/ from an uncommitted tree anyway")
    args = parser.parse_args()
    common.refuse_dirty(common.tree_state(), args.allow_dirty, args.out)

    import gguf
    import numpy as np

    from llmctl.gguf.quants import QUANTS, quantize
    from llmctl.report import run_metadata

    start_meta = run_metadata()
    x = np.random.default_rng(0).standard_normal((args.rows, args.cols)).astype(np.float32)
    rows = []
    for name in QUANTS:
        qtype = gguf.GGMLQuantizationType[name]
        ref = gguf.quants.quantize(x, qtype)
        same = bool(np.array_equal(ref, quantize(x, name, threads=1)))
        t_ref = best_of(lambda q=qtype: gguf.quants.quantize(x, q), args.repeat)
        t_1 = best_of(lambda n=name: quantize(x, n, threads=1), args.repeat)
        t_2 = best_of(lambda n=name: quantize(x, n, threads=2), args.repeat)
        rows.append({"type": name, "bit_exact": same, "gguf_py_s": t_ref, "llmctl_1t_s": t_1,
                     "llmctl_2t_s": t_2, "speedup_1t": t_ref / t_1, "speedup_2t": t_ref / t_2})
        print(f"{name:>5}  exact={same}  gguf-py {t_ref:.2f}s  llmctl 1t {t_1:.2f}s "
              f"({t_ref / t_1:.2f}x)  2t {t_2:.2f}s ({t_ref / t_2:.2f}x)", flush=True)
    result = {
        "benchmark": "gguf-legacy-quant-speed",
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv]),
        "shape": [args.rows, args.cols], "repeat": args.repeat,
        "metadata_start": start_meta, "metadata": run_metadata(), "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text(out.with_suffix(".json"), json.dumps(result, indent=2))
    load0 = start_meta["machine"].get("load_average")
    load1 = result["metadata"]["machine"].get("load_average")
    lines = [
        "# Legacy GGUF block quantizers: llmctl vs gguf-py",
        "",
        f"Command: `{result['command']}`",
        "",
        (f"A {args.rows} x {args.cols} float32 matrix (SmolLM2's token embedding shape), best "
        f"of {args.repeat}; baseline gguf-py {result['metadata']['versions'].get('gguf')} "
        f"measured in the same run. Load average {load0} at start, {load1} at end "
        f"({result['metadata']['machine']['cores']} cores, shared machine)."),
        "",
        ("| type | bit-exact | gguf-py (s) | llmctl 1 thread (s) | speed-up | llmctl 2 threads (s) "
        "| speed-up |"),
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['type']} | {'yes' if r['bit_exact'] else 'NO'} | {r['gguf_py_s']:.2f} | "
                     f"{r['llmctl_1t_s']:.2f} | {r['speedup_1t']:.2f}x | {r['llmctl_2t_s']:.2f} | "
                     f"{r['speedup_2t']:.2f}x |")
    write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
