"""Peak memory of ``llmctl eval``'s KLD pipeline over many tokens with a large vocabulary.

A synthetic reference and candidate (logits = hidden @ W with a 49,152-token
vocabulary; the candidate's W is perturbed) stand in for models so that only the
eval pipeline's own memory is measured: building the top-k reference store, then
comparing the candidate window by window.

    python benchmarks/eval_kld_memory.py --tokens 100000 --vocab 49152 --ctx 512 --top-k 64 \
        -o results/eval-kld-memory.json

Stated bound (see the JSON's ``bound_bytes``): peak RSS growth over the set-up
<= 2 x ctx x vocab x 4 bytes (one window's logits and one same-sized temporary of
the model producing them) + 4 x CHUNK_BYTES (row-chunk scratch, 16 MiB each)
+ 3 x N x (8k + 16) bytes (the kept rows, their concatenation when the store is
written, per-token statistics) + 64 MiB of allocator slack. It does not grow with
the number of windows except through the O(N k) term.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_RSS_AFTER_WINDOW: list[int] = []


def _trace(done: int, total: int) -> None:
    _RSS_AFTER_WINDOW.append(_rss_bytes())
    if os.environ.get("TRACE"):
        print(done, _rss_bytes() >> 20, _peak_bytes() >> 20, file=sys.stderr)


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


class FakeModel:
    """Dense logits for a window: a fixed random projection of per-token features."""

    def __init__(self, vocab: int, dim: int, seed: int, noise: float = 0.0) -> None:
        import torch

        gen = torch.Generator().manual_seed(0)
        self.embed = torch.randn(vocab, dim, generator=gen) * 0.5
        self.out = torch.randn(dim, vocab, generator=gen) * 0.8
        if noise:
            self.out += torch.randn(dim, vocab, generator=torch.Generator().manual_seed(seed)) * noise
        self.vocab = vocab

    def logits(self, ids: list[int]):
        import torch

        hidden = self.embed[torch.as_tensor(ids)]
        return hidden @ self.out  # [L, vocab] float32


def measure(tokens: int, vocab: int, ctx: int, top_k: int, dim: int = 32) -> dict:
    import torch

    from llmctl.eval.candidates import Candidate
    from llmctl.eval.memory import pin_mmap_threshold
    from llmctl.eval.metrics import comparison_summary
    from llmctl.eval.reference_store import build_store
    from llmctl.eval.runner import compare_windows
    from llmctl.eval.windows import Windowing, plan_windows

    pin_mmap_threshold()  # as run_eval does
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (tokens,)).tolist()
    plan = plan_windows(ids, Windowing(ctx=ctx), None)
    reference, candidate_model = FakeModel(vocab, dim, 0), FakeModel(vocab, dim, 1, noise=0.1)

    class FakeCandidate(Candidate, kind=None):
        tokenizer = None
        vocab_size = vocab

        def describe(self):
            return {"kind": "fake"}

        def logits(self, input_ids):
            return candidate_model.logits(input_ids)

    base = _rss_bytes()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        store = build_store(reference.logits, plan, top_k, Path(tmp) / "ref.safetensors", {},
                            _trace)
        store_bytes = store.path.stat().st_size
        built = time.perf_counter()
        stats, _ = compare_windows(FakeCandidate("fake", None), store, _trace)
        summary = comparison_summary(stats)
    end = time.perf_counter()
    peak = _peak_bytes()
    n = plan.scored_tokens
    # RSS after each window, over both passes: flat when nothing accumulates per window.
    creep = max(_RSS_AFTER_WINDOW[len(_RSS_AFTER_WINDOW) // 4:]) - _RSS_AFTER_WINDOW[0]
    from llmctl.eval.logprobs import CHUNK_BYTES

    bound = 2 * ctx * vocab * 4 + 4 * CHUNK_BYTES + 3 * n * (8 * top_k + 16) + (64 << 20)
    return {"tokens_scored": n, "windows": len(plan.inputs), "vocab": vocab, "ctx": ctx,
            "top_k": top_k, "baseline_rss_bytes": base, "peak_rss_bytes": peak,
            "peak_growth_bytes": peak - base, "bound_bytes": bound,
            "within_bound": peak - base <= bound, "rss_creep_bytes": creep,
            "store_bytes": store_bytes,
            "full_matrix_bytes": n * vocab * 4, "build_s": round(built - start, 2),
            "compare_s": round(end - built, 2), "mean_kld": summary["mean_kld"],
            "torch_threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--vocab", type=int, default=49_152)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("-o", "--output", type=Path)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    result = measure(args.tokens, args.vocab, args.ctx, args.top_k)
    if args.output:
        from llmctl.report import run_metadata

        record = {"metadata": run_metadata(command=" ".join(["python"] + sys.argv)),
                  "result": result}
        args.output.write_text(json.dumps(record, indent=2) + "\n")
        mib = lambda b: f"{b / 2**20:.0f} MiB"
        args.output.with_suffix(".md").write_text("\n".join([
            "# Eval KLD pipeline: peak memory", "",
            f"Command: `{record['metadata']['command']}`", "",
            (f"Machine: {record['metadata']['machine']['cpu']}, load average "
             f"{record['metadata']['machine']['load_average']}"), "",
            ("| tokens scored | vocab | ctx | top-k | peak RSS growth | stated bound | store file "
             "| full logits matrix | build | compare |"),
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            (f"| {result['tokens_scored']} | {result['vocab']} | {result['ctx']} "
             f"| {result['top_k']} | {mib(result['peak_growth_bytes'])} "
             f"| {mib(result['bound_bytes'])} | {mib(result['store_bytes'])} "
             f"| {mib(result['full_matrix_bytes'])} | {result['build_s']} s "
             f"| {result['compare_s']} s |"), ""]))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
