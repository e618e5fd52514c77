"""Draft-token proposers for speculative decoding.

Before each step the engine asks a proposer for up to ``k`` draft tokens per decoding
sequence; the target model then computes the last token and the drafts in one pass
(:mod:`llmctl.serve.model.runner`) and :mod:`llmctl.serve.sample.rejection_sampler` decides how
many to keep.

- :class:`NgramProposer` (prompt lookup decoding, Saxena 2023): find the most recent
  earlier occurrence of the sequence's last ``n`` tokens (``n`` from ``ngram_max`` down to
  ``ngram_min``) and propose the tokens that followed it. Free, and strong when the
  output quotes its input (summaries, extraction, code edits). Deterministic: ``q`` is
  one-hot.
- :class:`DraftModelProposer`: a smaller checkpoint with the same tokenizer runs ``k``
  autoregressive steps on its own paged cache, sampling with the request's parameters
  and keeping ``q`` for the rejection test. Its cache follows the target's tokens: after
  verification the rejected suffix is dropped, so the next step only catches up on the
  accepted drafts and the new token.
"""

from __future__ import annotations

import numpy as np
import torch

from llmctl.serve.core.block_manager import BlockManager
from llmctl.serve.core.scheduler import ScheduledSeq
from llmctl.serve.core.sequence import Sequence
from llmctl.serve.model.runner import ModelRunner, RunnerSeq
from llmctl.serve.sample.sampler import Sampler, exponential_race, generator_for


def ngram_lookup(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier match of the last n-gram."""
    length = len(tokens)
    if length < 2 or k <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = arr[length - n:]
        # windows starting at 0 .. length - n - 1 (the suffix itself excluded)
        windows = np.lib.stride_tricks.sliding_window_view(arr[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k]
    return []


class NgramProposer:
    def __init__(self, k: int, n_min: int, n_max: int) -> None:
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[tuple[list[int], None]]:
        return [(ngram_lookup(s.token_ids, min(self.k, lim), self.n_min, self.n_max), None)
                for s, lim in zip(seqs, limits)]

    def accepted(self, seq: Sequence) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, block_manager: BlockManager, k: int,
                 sampler: Sampler) -> None:
        self.runner = runner
        self.block_manager = block_manager
        self.k = k
        self.sampler = sampler
        self.shadows: dict[int, RunnerSeq] = {}

    def propose(self, seqs: list[Sequence], limits: list[int]
                ) -> list[tuple[list[int], torch.Tensor | None]]:
        bm = self.block_manager
        active: list[tuple[int, Sequence, RunnerSeq, int]] = []
        for row, (seq, limit) in enumerate(zip(seqs, limits)):
            k = min(self.k, limit)
            shadow = self.shadows.setdefault(seq.seq_id, RunnerSeq())
            shadow.token_ids = list(seq.token_ids)
            shadow.base = seq.num_tokens
            shadow.num_computed_tokens = min(shadow.num_computed_tokens, seq.num_tokens - 1)
            # the catch-up tokens and k - 1 drafts get KV (the last draft is only sampled)
            needed = seq.num_tokens - shadow.num_computed_tokens + k - 1
            if k <= 0 or bm.allocate(shadow, needed) is None:
                continue
            active.append((row, seq, shadow, k))
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for step in range(max((a[3] for a in active), default=0)):
            live = [a for a in active if a[3] > step]
            batch = [ScheduledSeq(sh, sh.num_tokens - sh.num_computed_tokens, 0)
                     for _, _, sh, _ in live]
            logits, _ = self.runner.execute(batch)
            params = [s.params for _, s, _, _ in live]
            processed = self.sampler.processed_logits(logits, params, [s for _, s, _, _ in live])
            greedy = processed.argmax(dim=-1).tolist()
            q = processed.softmax(dim=-1)
            drawn = greedy if all(p.greedy for p in params) else exponential_race(
                q, [generator_for(s) for _, s, _, _ in live], self.sampler.generator).tolist()
            for j, (row, seq, shadow, _) in enumerate(live):
                shadow.num_computed_tokens = shadow.num_tokens
                token = greedy[j] if seq.params.greedy else drawn[j]
                shadow.token_ids.append(token)
                drafts[row].append(token)
                probs[row].append(q[j])
        return [(d, torch.stack(p) if p else None) if d else ([], None)
                for d, p in zip(drafts, probs)]

    def accepted(self, seq: Sequence) -> None:
        """After verification: keep the draft cache only where it matches the target."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            return
        # everything before ``base`` is the target's own history; drafts start there
        common = min(shadow.base, shadow.num_computed_tokens)
        limit = min(shadow.num_computed_tokens, seq.num_tokens)
        target = seq.token_ids
        mine = shadow.token_ids
        while common < limit and mine[common] == target[common]:
            common += 1
        shadow.num_computed_tokens = common
        self.block_manager.trim(shadow, seq.num_tokens)

    def release(self, seq: Sequence) -> None:
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.block_manager.free_seq(shadow)
