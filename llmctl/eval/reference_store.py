"""Run the reference once; keep per scored token only what the comparisons need.

File layout (safetensors, read lazily window by window)::

    input_ids      [W, L]  int32    the windows as fed to the model (BOS included)
    rows           [N]     int32    scored row of each token inside its window
    offsets        [W + 1] int64    window w owns tokens offsets[w]:offsets[w+1]
    top_ids        [N, k]  uint16   reference top-k token ids, most likely first
                                    (int32 when the vocabulary exceeds 65,536)
    top_logprobs   [N, k]  float32  their log-probs
    tail_logprob   [N]     float32  log of the probability mass outside the top k
    target_logprob [N]     float32  log-prob of the actual next token

plus JSON metadata (model fingerprint, data source and hash, windowing, k, BOS).
Size: N * (6k + 12) bytes, ~40 MB for 100k tokens at k = 64, against 20 GB for
the full float32 vocab x tokens matrix of a 49k vocabulary.

Log-probs are float32. Float16 would save 2k bytes per token (27 instead of 40 MB per
100k tokens) at a measured KLD bias of ~5e-6 nats (results/eval-kld-topk.md): about
1 % of a good 8-bit checkpoint's mean KLD (4e-4 for SmolLM2 W8A16), and enough to
make a model compared with itself read non-zero.

Files are keyed by ``store_key``: the same reference, text, windowing, k, dtype and
library versions reuse one file for every candidate.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmctl.errors import ConfigError
from llmctl.eval.logprobs import reference_rows
from llmctl.eval.metrics import ReferenceRows
from llmctl.eval.windows import WindowPlan
from llmctl.utils.atomic import atomic_path

FORMAT = "llmctl-reference/1"


# The reference's numbers depend on the dtype it computes in and on the libraries that
# compute them, so both are part of a cached file's name.
COMPUTED_BY = ("torch", "transformers")


def store_key(model_hash: str, data_hash: str, windowing: dict, top_k: int,
              bos_id: int | None, *, dtype: str, runtime: str | None = None) -> str:
    """``runtime``: what computed the reference when not transformers (e.g. "serve")."""
    from llmctl.report import package_versions

    fields = {"format": FORMAT, "model": model_hash, "data": data_hash,
              "windowing": windowing, "top_k": top_k, "bos": bos_id, "dtype": dtype,
              "versions": package_versions(COMPUTED_BY)}
    if runtime is not None:  # absent for transformers: earlier stores keep their keys
        fields["runtime"] = runtime
    blob = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


@dataclass
class ReferenceStore:
    path: Path
    meta: dict[str, Any]
    plan: WindowPlan
    offsets: np.ndarray
    reused: bool = False  # loaded from an earlier run's cache rather than scored now

    @property
    def top_k(self) -> int:
        return int(self.meta["top_k"])

    @property
    def windows(self) -> int:
        return len(self.plan.inputs)

    def window(self, w: int) -> ReferenceRows:
        from safetensors import safe_open

        lo, hi = int(self.offsets[w]), int(self.offsets[w + 1])
        with safe_open(str(self.path), framework="np") as f:
            def part(name: str) -> np.ndarray:
                return f.get_slice(name)[lo:hi]

            return ReferenceRows(part("top_ids").astype(np.int64), part("top_logprobs"),
                                 part("tail_logprob"), part("target_logprob"))

    def target_logprobs(self) -> np.ndarray:
        from safetensors import safe_open

        with safe_open(str(self.path), framework="np") as f:
            return f.get_tensor("target_logprob")


def load_store(path: Path) -> ReferenceStore:
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="np") as f:
            raw = f.metadata() or {}
            input_ids = f.get_tensor("input_ids")
            rows = f.get_tensor("rows").astype(np.int64)
            offsets = f.get_tensor("offsets")
    except (SafetensorError, OSError, KeyError) as exc:
        raise ConfigError(f"{path} is not a readable llmctl reference store: {exc}",
                          "delete it; it is rebuilt from the reference model") from None
    if raw.get("format") != FORMAT:
        raise ConfigError(f"{path} has format {raw.get('format')!r}, expected {FORMAT}",
                          "delete it; it is rebuilt from the reference model")
    meta = json.loads(raw["meta"])
    plan = WindowPlan([list(map(int, w)) for w in input_ids],
                      [rows[offsets[w]:offsets[w + 1]] for w in range(len(input_ids))],
                      meta.get("bos_id"), int(meta.get("stream_tokens", 0)))
    return ReferenceStore(path, meta, plan, offsets)


def build_store(logits_fn: Callable[[list[int]], Any], plan: WindowPlan, top_k: int,
                path: Path, meta: dict[str, Any],
                progress: Callable[[int, int], None] | None = None) -> ReferenceStore:
    """Run ``logits_fn`` over every window and write the store atomically.

    Memory: one window's logits plus the O(N k) output arrays, allocated once up front
    (per-window arrays kept alive between big transient buffers fragment the heap:
    RSS then grows with every window).
    """
    n, counts = plan.scored_tokens, [len(r) for r in plan.rows]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    top_ids = top_lp = None
    tail = np.empty(n, dtype=np.float32)
    target = np.empty(n, dtype=np.float32)
    vocab = None
    for w, ids in enumerate(plan.inputs):
        logits = logits_fn(ids)
        vocab = int(logits.shape[-1])
        part = reference_rows(logits, plan.rows[w], plan.targets(w), top_k)
        del logits
        if top_ids is None:
            k = part.top_ids.shape[1]
            top_ids = np.empty((n, k), dtype=np.uint16 if vocab <= 65536 else np.int32)
            top_lp = np.empty((n, k), dtype=np.float32)
        lo, hi = offsets[w], offsets[w + 1]
        top_ids[lo:hi], top_lp[lo:hi] = part.top_ids, part.top_logprobs
        tail[lo:hi], target[lo:hi] = part.tail_logprob, part.target_logprob
        del part
        if progress:
            progress(w + 1, len(plan.inputs))
    tensors = {
        "input_ids": np.asarray(plan.inputs, dtype=np.int32),
        "rows": np.concatenate(plan.rows).astype(np.int32),
        "offsets": offsets,
        "top_ids": top_ids,
        "top_logprobs": top_lp,
        "tail_logprob": tail,
        "target_logprob": target,
    }
    meta = {**meta, "top_k": int(tensors["top_ids"].shape[1]), "vocab_size": vocab,
            "bos_id": plan.bos_id, "stream_tokens": plan.stream_tokens,
            "scored_tokens": plan.scored_tokens}
    from safetensors.numpy import save_file

    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": FORMAT, "meta": json.dumps(meta)})
    return load_store(path)
