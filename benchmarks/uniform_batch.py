"""Per-step efficiency on a uniform batch: llmctl's engine vs transformers ``generate``.

32 prompts of 10-14 tokens (windows of stdlib prose), 64 new tokens each (greedy,
``ignore_eos``/``min_new_tokens``), all submitted at once: every row has the same length
of work, so static batching loses nothing and continuous batching gains nothing. What is
left is the forward pass itself (and each side's per-step overhead). transformers runs
the 32 prompts as one left-padded batch, the engine as 32 requests (prefix caching off).

Per dtype (float32 and bfloat16), one process holds both sides and alternates them
(engine first in odd rounds, transformers first in even ones) after a warm-up run of
each; every round is reported with the load average and the CPU other processes used.
Headline: the median of the per-round ratios (engine / transformers output tokens/s).
Target (issue 16): >= 1.5x in both dtypes.

A correctness check beside the speed: in float32 the engine's greedy tokens are
compared with transformers' (sequences identical over all 64 tokens, and where the
others first differ); in bfloat16 only reported (both sides round differently, so a
near-tie may flip a token). In development runs 30/32 float32 sequences were identical
and the other two first differed at tokens 27 and 28, with the engine's float32 layers
on ``F.linear`` as well as on oneDNN's packed GEMM: near-ties under another summation
order (transformers one prompt at a time, unpadded, gives its batched tokens).

    python benchmarks/uniform_batch.py --rounds 3
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common

PROMPTS, NEW_TOKENS, PROMPT_RANGE = 32, 64, (10, 14)
TARGET = 1.5
DTYPES = ("float32", "bfloat16")


def prompts(tokenizer, seed: int = 0) -> list[list[int]]:
    from llmctl.data.sources import load_text_source, token_stream

    ids = token_stream(tokenizer, load_text_source("builtin:pydoc-calib"))
    rng = random.Random(seed)
    out = []
    for _ in range(PROMPTS):
        n = rng.randint(*PROMPT_RANGE)
        start = rng.randint(0, len(ids) - n - 1)
        out.append(ids[start:start + n])
    return out


class Sides:
    """Both sides for one dtype, loaded once; each call runs the whole batch."""

    def __init__(self, model: str, dtype: str, work: list[list[int]]) -> None:
        import torch

        from llmctl.models.loading import load_model, load_tokenizer
        from llmctl.models.resolve import resolve_model
        from llmctl.serve.engine.llm import LLM

        path = resolve_model(model).path
        self.work = work
        self.llm = LLM(model, dtype=dtype, enable_prefix_caching=False,
                       max_num_seqs=PROMPTS)
        self.hf = load_model(Path(path), dtype)
        tok = load_tokenizer(Path(path))
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        width = max(len(p) for p in work)
        self.ids = torch.full((len(work), width), self.pad, dtype=torch.long)
        self.mask = torch.zeros((len(work), width), dtype=torch.long)
        for r, p in enumerate(work):  # left padding, as generate wants for decoder-only
            self.ids[r, width - len(p):] = torch.tensor(p)
            self.mask[r, width - len(p):] = 1

    def engine(self) -> tuple[float, list[list[int]]]:
        from llmctl.serve.core.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        start = time.perf_counter()
        outs = self.llm.generate(self.work, params)
        wall = time.perf_counter() - start
        return wall, [list(o.outputs[0].token_ids) for o in outs]

    def transformers(self) -> tuple[float, list[list[int]]]:
        import torch

        start = time.perf_counter()
        with torch.inference_mode():
            out = self.hf.generate(self.ids, attention_mask=self.mask, do_sample=False,
                                   max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                   pad_token_id=self.pad)
        wall = time.perf_counter() - start
        return wall, out[:, self.ids.shape[1]:].tolist()


def run_dtype(model: str, dtype: str, work, rounds: int, threads: int) -> dict:
    sides = Sides(model, dtype, work)
    runs = {"engine": sides.engine, "transformers": sides.transformers}
    for fn in runs.values():  # warm-up: kernels built, allocator and caches primed
        fn()
    records, tokens = [], {}
    for rnd in range(rounds):
        order = ("engine", "transformers") if rnd % 2 == 0 else ("transformers", "engine")
        pair = {}
        for side in order:
            record = {"name": f"{dtype} {side} round {rnd + 1}", "dtype": dtype, "side": side,
                      "round": rnd + 1}
            with common.measured_round(record, threads):
                wall, tokens[side] = runs[side]()
            record.update(wall_s=round(wall, 3),
                          output_tok_s=round(PROMPTS * NEW_TOKENS / wall, 1))
            pair[side] = record
            records.append(record)
            print(f"{record['name']}: {record['output_tok_s']} tok/s", file=sys.stderr,
                  flush=True)
        pair["engine"]["ratio"] = round(pair["engine"]["output_tok_s"]
                                        / pair["transformers"]["output_tok_s"], 3)
    ratios = [r["ratio"] for r in records if "ratio" in r]
    pairs = list(zip(tokens["engine"], tokens["transformers"]))
    same = sum(a == b for a, b in pairs)
    first_diff = [next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
                  for a, b in pairs if a != b]
    return {"dtype": dtype, "rounds": records,
            "engine_tok_s_median": common.median(
                [r["output_tok_s"] for r in records if r["side"] == "engine"]),
            "transformers_tok_s_median": common.median(
                [r["output_tok_s"] for r in records if r["side"] == "transformers"]),
            "ratio_median": common.median(ratios), "ratio_min": min(ratios),
            "identical_sequences": same, "sequences": len(work),
            "first_differing_token": first_diff}


def _diverge(d: dict) -> str:
    at = d.get("first_differing_token") or []
    return f" (the others from token {', '.join(map(str, at))})" if at else ""


def markdown(report: dict) -> str:
    lines = common.header_markdown(report, "Uniform batch: llmctl engine vs transformers "
                                           "generate (SmolLM2, offline)")
    lines += [(f"{PROMPTS} prompts of {PROMPT_RANGE[0]}-{PROMPT_RANGE[1]} tokens, "
               f"{NEW_TOKENS} new tokens each (greedy), all at once; transformers as one "
               "left-padded batch, the engine as 32 requests (prefix caching off); both "
               f"{report['threads']} torch threads, in one process, alternating."), "",
              ("| dtype | engine tok/s (median) | transformers tok/s (median) | "
               "engine / transformers (median of rounds; min) | target | identical greedy "
               "sequences |"), "|---|---|---|---|---|---|"]
    for d in report["dtypes"]:
        lines.append(f"| {d['dtype']} | {d['engine_tok_s_median']:.1f} | "
                     f"{d['transformers_tok_s_median']:.1f} | {d['ratio_median']:.2f}x; "
                     f"{d['ratio_min']:.2f}x | >= {TARGET}x | {d['identical_sequences']}/"
                     f"{d['sequences']}{_diverge(d)} |")
    lines += ["", "Every round:", "",
              ("| dtype | round | side | output tok/s | wall s | engine / transformers | "
               "load before / after | other procs (cores) |"), "|---|---|---|---|---|---|---|---|"]
    for d in report["dtypes"]:
        for r in d["rounds"]:
            ratio = f"{r['ratio']:.2f}x" if "ratio" in r else ""
            lines.append(f"| {r['dtype']} | {r['round']} | {r['side']} | {r['output_tok_s']} "
                         f"| {r['wall_s']} | {ratio} | {r['load_before'][0]} / "
                         f"{r['load_after'][0]} | {r['foreign_cpu_cores']} |")
    lines += ["", "Raw numbers: the JSON file next to this one.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    common.add_run_arguments(ap)
    args = ap.parse_args(argv)
    import torch

    from llmctl.models.loading import load_tokenizer
    from llmctl.models.resolve import resolve_model

    torch.set_num_threads(args.threads)
    out_dir = Path(args.out_dir)
    report = common.start_run("uniform-batch", {"rounds": args.rounds, "prompts": PROMPTS,
                                                "new_tokens": NEW_TOKENS,
                                                "prompt_range": PROMPT_RANGE},
                              allow_dirty=args.allow_dirty, threads=args.threads, out=out_dir)
    work = prompts(load_tokenizer(Path(resolve_model(args.model).path)))
    report["dtypes"] = [run_dtype(args.model, d, work, args.rounds, args.threads)
                        for d in args.dtypes.split(",")]
    common.finish_run(report, [r for d in report["dtypes"] for r in d["rounds"]])
    path = common.write_report(out_dir, "uniform-batch-smollm2", report, markdown(report))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
