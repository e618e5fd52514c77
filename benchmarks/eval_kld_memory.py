"""Peak memory of ``llmctl eval``'s KLD pipeline over many tokens with a large vocabulary.

A synthetic reference and candidate (logits = hidden @ W with a 49,152-token
vocabulary; the candidate's W is perturbed) stand in for models so that only the
eval pipeline's own memory is measured: building the top-k reference store, then
comparing the candidate window by window.

    python benchmarks/eval_kld_memory.py --tokens 100000 --vocab 49152 --ctx 512 --top-k 64 \
        -o results/eval-kld-memory.json

Stated bound (see the JSON's ``bound_bytes``): peak growth of anonymous memory over
the set-up <= 2 x ctx x vocab x 4 bytes (one window's logits and one same-sized
temporary of the model producing them) + 4 x CHUNK_BYTES (row-chunk scratch, 16 MiB
each) + 3 x N x (8k + 16) bytes (the kept rows, their concatenation when the store is
written, per-token statistics) + 64 MiB of allocator slack. It does not grow with the
number of windows except through the O(N k) term.

Anonymous memory (``RssAnon``, sampled every millisecond by a thread) is what the
pipeline allocates. Total RSS also counts file-backed pages of torch's shared
libraries, which a busy machine evicts and the process faults back in: measured that
way the same run "grew" by a different amount at load 10 than on an idle machine, so
the total high-water mark (``VmHWM``, reset after the set-up) is reported, not gated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import common

from llmctl.utils.atomic import write_text


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _anon_bytes() -> int:
    return _status_bytes("RssAnon")


def _reset_high_water_mark() -> bool:
    """Linux >= 4.0: writing 5 to clear_refs resets VmHWM to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class AnonPeak:
    """Samples RssAnon every millisecond in a thread (torch ops release the GIL)."""

    def __init__(self) -> None:
        self.peak = _anon_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _anon_bytes())

    def __enter__(self) -> AnonPeak:  # noqa: PYI034
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _anon_bytes())


_ANON_AFTER_WINDOW: list[int] = []


def _trace(done: int, total: int) -> None:
    _ANON_AFTER_WINDOW.append(_anon_bytes())
    if os.environ.get("TRACE"):
        print(done, _anon_bytes() >> 20, _status_bytes("VmHWM") >> 20, file=sys.stderr)


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

    base = _anon_bytes()
    hwm_reset = _reset_high_water_mark()
    base_rss = _status_bytes("VmRSS")
    start = time.perf_counter()
    with AnonPeak() as peak, tempfile.TemporaryDirectory() as tmp:
        store = build_store(reference.logits, plan, top_k, Path(tmp) / "ref.safetensors", {},
                            _trace)
        store_bytes = store.path.stat().st_size
        built = time.perf_counter()
        stats, _ = compare_windows(FakeCandidate("fake", None), store, _trace)
        summary = comparison_summary(stats)
    end = time.perf_counter()
    n = plan.scored_tokens
    # After each window, over both passes: flat when nothing accumulates per window.
    creep = max(_ANON_AFTER_WINDOW[len(_ANON_AFTER_WINDOW) // 4:]) - _ANON_AFTER_WINDOW[0]
    from llmctl.eval.logprobs import CHUNK_BYTES

    bound = 2 * ctx * vocab * 4 + 4 * CHUNK_BYTES + 3 * n * (8 * top_k + 16) + (64 << 20)
    return {"tokens_scored": n, "windows": len(plan.inputs), "vocab": vocab, "ctx": ctx,
            "top_k": top_k, "baseline_anon_bytes": base, "peak_anon_bytes": peak.peak,
            "peak_growth_bytes": peak.peak - base, "bound_bytes": bound,
            "within_bound": peak.peak - base <= bound, "rss_creep_bytes": creep,
            "rss_high_water_growth_bytes": (_status_bytes("VmHWM") - base_rss) if hwm_reset
            else None,
            "store_bytes": store_bytes, "full_matrix_bytes": n * vocab * 4,
            "build_s": round(built - start, 2), "compare_s": round(end - built, 2),
            "mean_kld": summary["mean_kld"], "torch_threads": torch.get_num_threads(),
            "load_average": list(os.getloadavg())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--vocab", type=int, default=49_152)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("-o", "--output", type=Path)
    parser.add_argument("--allow-dirty", action="store_true",
                        help="write results/ from an uncommitted tree anyway")
    args = parser.parse_args()
    if args.output:
        common.refuse_dirty(common.tree_state(), args.allow_dirty, args.output)
    import torch

    torch.set_num_threads(args.threads)
    result = measure(args.tokens, args.vocab, args.ctx, args.top_k)
    if args.output:
        from llmctl.report import run_metadata

        record = {"metadata": run_metadata(command=" ".join(["python"] + sys.argv)),
                  "result": result}
        write_text(args.output, json.dumps(record, indent=2) + "\n")
        mib = lambda b: f"{b / 2**20:.0f} MiB"
        write_text(args.output.with_suffix(".md"), "\n".join([
            "# Eval KLD pipeline: peak memory", "",
            f"Command: `{record['metadata']['command']}`", "",
            (f"Machine: {record['metadata']['machine']['cpu']}, load average "
             f"{record['metadata']['machine']['load_average']}"), "",
            ("| tokens scored | vocab | ctx | top-k | peak anon growth | stated bound "
             "| RSS high-water growth | store file | full logits matrix | build | compare |"),
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            (f"| {result['tokens_scored']} | {result['vocab']} | {result['ctx']} "
             f"| {result['top_k']} | {mib(result['peak_growth_bytes'])} "
             f"| {mib(result['bound_bytes'])} "
             f"| {mib(result['rss_high_water_growth_bytes'] or 0)} "
             f"| {mib(result['store_bytes'])} "
             f"| {mib(result['full_matrix_bytes'])} | {result['build_s']} s "
             f"| {result['compare_s']} s |"), "",
            ("Anonymous memory (RssAnon, sampled every ms) is gated; the total RSS high-water "
             "mark also counts torch's library pages, which vary with machine pressure."), ""]))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
