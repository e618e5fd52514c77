"""Token choice: a step's logits to each sequence's new tokens, and where they stop.

- :func:`draw`: one token per plain row (a sequence without drafts), in one batch;
- :func:`verify`: a speculative sequence's rows accept or reject its draft tokens
  (greedy: the argmax; sampled: rejection sampling against the proposer's q);
- :func:`append_tokens`: the chosen tokens go onto the sequence one by one up to the
  first stop condition (EOS or a stop token, a stop string, a finished constraint,
  ``max_tokens`` or the context length).

None of them changes the engine's bookkeeping (blocks, scheduler, counters, outputs):
:class:`~llmctl.serve.engine.llm_engine.LLMEngine` does, around them. ``draw`` and
``verify`` change no sequence at all, so a batch that raises can be run again one
sequence at a time.
"""

from __future__ import annotations

import torch

from llmctl.serve.core.sequence import Sequence, SequenceStatus
from llmctl.serve.model.runner import LogitRows
from llmctl.serve.sample.rejection_sampler import greedy_verify, rejection_sample
from llmctl.serve.sample.sampler import Sampler, generator_for

# the tokens a sequence gets in a step and their logprobs (None: not asked for)
Choice = tuple[list[int], "list | None"]


def draw(sampler: Sampler, logits: torch.Tensor, units: list[tuple[int, Sequence]]
         ) -> list[Choice]:
    """One token (and its logprobs when asked) per (logits row, sequence)."""
    index = [row for row, _ in units]
    seqs = [seq for _, seq in units]
    sub = logits if index == list(range(logits.shape[0])) else logits[index]
    tokens = sampler.sample(sub, seqs)
    top_n = [s.params.logprobs for s in seqs]
    lps = (Sampler.logprobs(sub, tokens, [n or 0 for n in top_n])
           if any(n is not None for n in top_n) else None)
    return [([tokens[i]], [lps[i]] if lps and top_n[i] is not None else None)
            for i in range(len(seqs))]


def _split(flat, spec: list[LogitRows]) -> dict:
    """Consecutive parts of ``flat``, one per sequence of ``spec`` (``count`` rows each)."""
    parts = {}
    offset = 0
    for r in spec:
        parts[r.item.seq.seq_id] = flat[offset:offset + r.count]
        offset += r.count
    return parts


def verify(sampler: Sampler, spec: list[LogitRows], logits: torch.Tensor,
           draft_probs: dict[int, torch.Tensor | None]) -> list[Choice]:
    """Accept or reject each sequence's draft tokens (one batched pass over the rows):
    the tokens to append and their logprobs. ``draft_probs``: the proposer's q per
    sequence (None or absent: a deterministic proposer)."""
    sampled = [r for r in spec if not r.item.seq.params.greedy]
    probs: dict[int, torch.Tensor] = {}
    if sampled:
        index = [r.start + j for r in sampled for j in range(r.count)]
        params = [r.item.seq.params for r in sampled for _ in range(r.count)]
        seqs = [r.item.seq for r in sampled for _ in range(r.count)]
        probs = _split(sampler.processed_logits(logits[index], params, seqs).softmax(dim=-1),
                       sampled)
    greedy = [r for r in spec if r.item.seq.params.greedy]
    argmax = {}
    if greedy:
        index = [r.start + j for r in greedy for j in range(r.count)]
        argmax = _split(logits[index].argmax(dim=-1).tolist(), greedy)
    results = []
    for r in spec:
        seq = r.item.seq
        draft = list(seq.spec_token_ids[:r.item.num_spec_tokens])
        if seq.seq_id in argmax:
            tokens = greedy_verify(draft, argmax[seq.seq_id])
        else:
            q = draft_probs.get(seq.seq_id)
            tokens = rejection_sample(draft, probs[seq.seq_id],
                                      None if q is None else q[:len(draft)],
                                      generator_for(seq) or sampler.generator)
        lps = None
        if seq.params.logprobs is not None:
            lps = Sampler.logprobs(logits[r.start:r.start + len(tokens)], tokens,
                                   [seq.params.logprobs] * len(tokens))
        results.append((tokens, lps))
    return results


def append_tokens(seq: Sequence, tokens: list[int], logprobs: list | None,
                  max_model_len: int) -> SequenceStatus | None:
    """Add chosen tokens one by one, stopping at the first stop condition: the status
    that ends the sequence (None: it goes on). Accepted drafts past the stop are not
    added and their KV no longer counts as computed."""
    params = seq.params
    stop_ids = params.stop_token_ids
    status = None
    for i, token in enumerate(tokens):
        seq.token_ids.append(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs[i])
        if token in seq.request.eos_token_ids or token in stop_ids:
            seq._stop_reason = token if token in stop_ids else None
            status = SequenceStatus.FINISHED_STOPPED
        elif seq.detok.append(token):
            seq._stop_reason = seq.detok.stop_reason
            status = SequenceStatus.FINISHED_STOPPED
        elif seq.constraint is not None and _advance_constraint(seq, token):
            status = SequenceStatus.FINISHED_STOPPED
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            if i + 1 < len(tokens):  # accepted drafts past the stop are dropped
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
            break
    return status


def _advance_constraint(seq: Sequence, token: int) -> bool:
    """Feed an appended output token to the sequence's constraint (once per token,
    whatever recomputation happens later); True when it can take no more."""
    seq.constraint.accept(token)
    return seq.constraint.is_finished()
