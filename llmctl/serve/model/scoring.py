"""Full logit rows of a token sequence through the engine's own model and paged cache.

For precision checks (KLD against a float32 reference, tests against transformers):
:func:`teacher_forced_logits` sends the first ``first_chunk`` tokens through one prefill
step, every later token through its own decode step (K/V read back through the block
table), which is how served requests compute; each step's logits row scores the next
token. :func:`prompt_logits` scores every position of one prefill step (``llmctl eval
--backend serve``): with an 8-bit KV cache that prefill attends over the K/V as the
cache holds them (:meth:`llmctl.serve.model.decoder.LlamaModel.forward`), so its rows carry the
error decode steps would see.
"""

from __future__ import annotations

import torch

from llmctl.serve.core.scheduler import ScheduledSeq
from llmctl.serve.model.runner import RunnerSeq


def teacher_forced_logits(engine, ids: list[int], first_chunk: int) -> torch.Tensor:
    """Logits ``[len(ids) - first_chunk + 1, vocab]`` at positions ``first_chunk - 1 ..``
    (an idle engine's blocks are borrowed and returned)."""
    if not 1 <= first_chunk <= len(ids):
        raise ValueError(f"first_chunk must be in 1..{len(ids)}, got {first_chunk}")
    seq = RunnerSeq()
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


class _Request:
    needs_prompt_logits = True
    lora = None  # scored on the base model
    pooled = None  # logits, not an embedding


class _Prompt(RunnerSeq):
    """A prompt that wants every position's logits (what the runner reads of one)."""

    __slots__ = ("request",)

    def __init__(self, ids: list[int]) -> None:
        super().__init__()
        self.token_ids = list(ids)
        self.request = _Request()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)


def prompt_logits(engine, ids: list[int]) -> torch.Tensor:
    """Logits ``[len(ids), vocab]``, row ``p`` scoring token ``p + 1``, from one prefill
    step of the whole sequence (an idle engine's blocks are borrowed and returned)."""
    if not ids:
        raise ValueError("no tokens to score")
    seq = _Prompt(ids)
    try:
        if engine.block_manager.allocate(seq, len(ids)) is None:
            raise RuntimeError("the KV cache is too small for this sequence")
        last, _, prompt = engine.runner.execute_with_prompt([ScheduledSeq(seq, len(ids), 0)])
    finally:
        engine.block_manager.free_seq(seq)
    return torch.cat([p.logits for p in prompt] + [last])
