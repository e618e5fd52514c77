"""From one window's logits to the per-token rows the metrics use (tensors in, arrays out).

Rows are normalised in chunks of at most ``CHUNK_BYTES`` of float32, so beyond the
window's logits themselves (ctx x vocab x 4 bytes: 100 MB for ctx 512 and SmolLM2's
49,152 tokens) the scratch memory is a few chunks, whatever the text length.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from llmctl.eval.metrics import CandidateRows, ReferenceRows

CHUNK_BYTES = 16 << 20


def _chunks(logits, rows: np.ndarray) -> Iterator[tuple[slice, object]]:
    """(slice into ``rows``, float32 log-softmax of those rows) pairs; each a fresh copy."""
    import torch

    vocab = int(logits.shape[-1])
    step = max(1, CHUNK_BYTES // (4 * vocab))
    for lo in range(0, len(rows), step):
        part = slice(lo, min(lo + step, len(rows)))
        # the rows come to the CPU: the metrics are numpy arrays, and a GPU candidate's
        # logits (the serving engine on CUDA) would otherwise meet CPU index tensors
        index = torch.as_tensor(rows[part], dtype=torch.long, device=logits.device)
        lp = logits[index].to(device="cpu", dtype=torch.float32)
        lp -= torch.logsumexp(lp, dim=-1, keepdim=True)
        yield part, lp


def _gather(lp, ids: np.ndarray):
    import torch

    return lp.gather(1, torch.as_tensor(np.asarray(ids, dtype=np.int64)))


def _logsumexp_outside(lp, ids):
    """log of the probability mass outside ``ids`` per row (overwrites ``lp``)."""
    import torch

    lp.scatter_(1, ids, float("-inf"))
    return torch.logsumexp(lp, dim=-1)  # -inf when ids cover the whole vocabulary


def reference_rows(logits, rows: np.ndarray, targets: np.ndarray, k: int) -> ReferenceRows:
    """Top-k log-probs (descending), the log of the mass left over, and the target's."""
    k = min(k, int(logits.shape[-1]))
    n = len(rows)
    top_ids = np.empty((n, k), dtype=np.int32)
    top_lp = np.empty((n, k), dtype=np.float32)
    tail = np.empty(n, dtype=np.float32)
    target = np.empty(n, dtype=np.float32)
    for part, lp in _chunks(logits, rows):
        target[part] = _gather(lp, targets[part, None])[:, 0].numpy()
        values, ids = lp.topk(k, dim=-1, sorted=True)
        top_ids[part], top_lp[part] = ids.numpy(), values.numpy()
        tail[part] = _logsumexp_outside(lp, ids).numpy()
    return ReferenceRows(top_ids, top_lp, tail, target)


def candidate_rows(logits, rows: np.ndarray, targets: np.ndarray,
                   reference_ids: np.ndarray | None = None) -> CandidateRows:
    """Log q of the actual tokens, the top token, and log q at the reference's top ids."""
    import torch

    n = len(rows)
    target = np.empty(n, dtype=np.float32)
    top1 = np.empty(n, dtype=np.int64)
    at = rest = None
    if reference_ids is not None:
        at = np.empty(reference_ids.shape, dtype=np.float32)
        rest = np.empty(n, dtype=np.float32)
    for part, lp in _chunks(logits, rows):
        target[part] = _gather(lp, targets[part, None])[:, 0].numpy()
        top1[part] = lp.topk(1, dim=-1).indices[:, 0].numpy()  # topk, as the reference: ties agree
        if reference_ids is not None:
            ids = torch.as_tensor(np.asarray(reference_ids[part], dtype=np.int64))
            at[part] = lp.gather(1, ids).numpy()
            rest[part] = _logsumexp_outside(lp, ids).numpy()
    return CandidateRows(target, top1, at, rest)
