"""Full logit rows of a token sequence through the engine's own model and paged cache.

For precision checks (KLD against a float32 reference, tests against transformers):
the first ``first_chunk`` tokens go through one prefill step, every later token through
its own decode step (K/V read back through the block table), which is how served
requests compute; each step's logits row scores the next token.
"""

from __future__ import annotations

import torch

from llmctl.serve.scheduler import ScheduledSeq
from llmctl.serve.spec_decode import _Shadow


def teacher_forced_logits(engine, ids: list[int], first_chunk: int) -> torch.Tensor:
    """Logits ``[len(ids) - first_chunk + 1, vocab]`` at positions ``first_chunk - 1 ..``
    (an idle engine's blocks are borrowed and returned)."""
    if not 1 <= first_chunk <= len(ids):
        raise ValueError(f"first_chunk must be in 1..{len(ids)}, got {first_chunk}")
    seq = _Shadow()
    seq.token_ids = list(ids[:first_chunk])
    rows = []
    try:
        while True:
            n = seq.num_tokens - seq.num_computed_tokens
            if engine.block_manager.allocate(seq, n) is None:
                raise RuntimeError("the KV cache is too small for this sequence")
            logits, _ = engine.runner.execute([ScheduledSeq(seq, n, 0)])
            rows.append(logits[0])
            seq.num_computed_tokens = seq.num_tokens
            if seq.num_tokens == len(ids):
                break
            seq.token_ids.append(ids[seq.num_tokens])
    finally:
        engine.block_manager.free_seq(seq)
    return torch.stack(rows)
