"""How much KL divergence the top-k reference store keeps, on SmolLM2 (real logits).

For a few held-out windows, computes the full-vocabulary KL(P_ref || Q_cand) per token
and the store's coarse KL (reference top-k + one lumped tail bucket) for several k,
with the top-k log-probs kept in float32 and, for comparison, rounded to float16.
Candidates are stand-ins made in memory by round-to-nearest fake quantization of the
linear weights (symmetric, per group along the input dimension): int8 per channel and
int4 with group 32 -- enough to have a small and a large divergence.

    python benchmarks/eval_kld_topk.py --windows 4 --ctx 512 -o results/eval-kld-topk.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import common
import numpy as np
import torch

from llmctl.utils.atomic import write_text


def fake_quantize(model, bits: int, group: int | None) -> None:
    """Round each Linear weight (not lm_head) to a symmetric ``bits`` grid, in place."""
    qmax = 2 ** (bits - 1) - 1
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
                w = module.weight
                g = group or w.shape[1]
                blocks = w.reshape(w.shape[0], -1, g)
                scale = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-12) / qmax
                w.copy_((blocks / scale).round().clamp(-qmax - 1, qmax).mul(scale).reshape(w.shape))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("-o", "--output", type=Path)
    parser.add_argument("--allow-dirty", action="store_true",
                        help="write results/ from an uncommitted tree anyway")
    args = parser.parse_args()
    if args.output:
        common.refuse_dirty(common.tree_state(), args.allow_dirty, args.output)
    torch.set_num_threads(args.threads)

    from llmctl.data.sources import load_text_source, token_stream
    from llmctl.eval.logprobs import candidate_rows, reference_rows
    from llmctl.eval.metrics import coarse_kld
    from llmctl.eval.windows import Windowing, plan_windows
    from llmctl.models.loading import load_model, load_tokenizer
    from llmctl.models.resolve import resolve_model
    from llmctl.report import run_metadata

    path = resolve_model("smollm2-135m").path
    tok = load_tokenizer(path)
    ids = token_stream(tok, load_text_source("builtin:pydoc-heldout"))
    plan = plan_windows(ids, Windowing(ctx=args.ctx, max_windows=args.windows), None)
    reference = load_model(path)
    ks = (8, 16, 32, 64, 128)
    variants = {"int8-channel": (8, None), "int4-g32": (4, 32)}
    start = time.perf_counter()
    ref_logits = []
    with torch.inference_mode():
        for inputs in plan.inputs:
            ref_logits.append(reference(torch.tensor([inputs])).logits[0])
    results = {}
    for name, (bits, group) in variants.items():
        cand = load_model(path)
        fake_quantize(cand, bits, group)
        full, coarse = [], {k: [] for k in ks}
        coarse16 = {k: [] for k in ks}
        tail_mass = {k: [] for k in ks}
        with torch.inference_mode():
            for w, inputs in enumerate(plan.inputs):
                q_logits = cand(torch.tensor([inputs])).logits[0]
                rows, targets = plan.rows[w], plan.targets(w)
                p = ref_logits[w][rows].double().log_softmax(-1)
                q = q_logits[rows].double().log_softmax(-1)
                full.append((p.exp() * (p - q)).sum(-1).numpy())
                for k in ks:
                    ref = reference_rows(ref_logits[w], rows, targets, k)
                    c = candidate_rows(q_logits, rows, targets, ref.top_ids)
                    coarse[k].append(coarse_kld(ref.top_logprobs, ref.tail_logprob,
                                                c.at_reference, c.rest_logprob))
                    # The same with the stored log-probs rounded to float16.
                    coarse16[k].append(coarse_kld(
                        ref.top_logprobs.astype(np.float16).astype(np.float32),
                        ref.tail_logprob.astype(np.float16).astype(np.float32),
                        c.at_reference, c.rest_logprob))
                    tail_mass[k].append(np.exp(ref.tail_logprob.astype(np.float64)))
        full_mean = float(np.concatenate(full).mean())
        results[name] = {"full_mean_kld": full_mean, "by_k": {
            str(k): {"mean_kld": float(np.concatenate(coarse[k]).mean()),
                     "kept_fraction": float(np.concatenate(coarse[k]).mean()) / full_mean,
                     "mean_kld_fp16_store": float(np.concatenate(coarse16[k]).mean()),
                     "fp16_bias": float(np.concatenate(coarse16[k]).mean()
                                        - np.concatenate(coarse[k]).mean()),
                     "mean_tail_mass": float(np.concatenate(tail_mass[k]).mean())}
            for k in ks}}
        del cand
    elapsed = time.perf_counter() - start
    record = {"metadata": run_metadata(command=" ".join(["python"] + sys.argv),
                                       tokens_scored=plan.scored_tokens, windows=len(plan.inputs),
                                       ctx=args.ctx, seconds=round(elapsed, 1)),
              "results": results}
    print(json.dumps(results, indent=2))
    if args.output:
        write_text(args.output, json.dumps(record, indent=2) + "\n")
        lines = ["# Top-k reference store vs full-vocabulary KLD (SmolLM2-135M)", "",
                 f"Command: `{record['metadata']['command']}`  ",
                 (f"{plan.scored_tokens} tokens of builtin:pydoc-heldout in {len(plan.inputs)} "
                  f"windows of {args.ctx}; load average "
                  f"{record['metadata']['machine']['load_average']}"), "",
                 ("Candidates: in-memory round-to-nearest fake quantization of every Linear but "
                  "lm_head (stand-ins for real quantized checkpoints)."), "",
                 ("| candidate | full KLD | k | top-k KLD | kept | fp16-store KLD | fp16 bias "
                  "| mean tail mass |"), "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, r in results.items():
            for k, v in r["by_k"].items():
                lines.append(f"| {name} | {r['full_mean_kld']:.6f} | {k} | {v['mean_kld']:.6f} "
                             f"| {100 * v['kept_fraction']:.2f} % | {v['mean_kld_fp16_store']:.6f} "
                             f"| {v['fp16_bias']:+.2e} | {v['mean_tail_mass']:.4f} |")
        write_text(args.output.with_suffix(".md"), "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
