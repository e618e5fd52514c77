"""From logits to tokens: penalties, temperature, top-k/top-p/min-p, seeded draws, logprobs.

Order (that of HF ``generate``'s processors): ``logit_bias`` is added to the raw logits
and a structured-output constraint masks them, then penalties, temperature, top-k,
top-p, min-p. Greedy rows take the argmax of the biased, masked, penalised logits.
Logprobs stay those of the raw logits (vLLM's default, ``raw_logprobs``).

Sampling uses the exponential race: ``argmax_i p_i / E_i`` with ``E_i ~ Exp(1)`` is a
draw from ``p`` (the Gumbel-max trick in another form), so a seeded request draws its
``E`` from its own ``torch.Generator`` and gets the same tokens whatever shares its
batch; unseeded rows share the engine's generator in one batched draw.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.core.sequence import Sequence
from llmctl.serve.sample.logits_process import apply_constraints, apply_logit_bias


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-n (token id, logprob), most likely first

    def to_dict(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob,
                "top": [list(t) for t in self.top]}


def generator_for(seq: Sequence) -> torch.Generator | None:
    seed = seq.params.seed
    if seed is None:
        return None
    if seq.generator is None:
        # uint64 arithmetic, as manual_seed reads a negative seed (see SamplingParams)
        seq.generator = torch.Generator().manual_seed((seed + seq.index) % 2**64)
    return seq.generator


def generator_snapshot(seqs: list[Sequence]) -> Callable[[], None]:
    """A function that puts the seeded sequences' generators back where they are now
    (a generator not made yet is dropped again): a computation re-run after a failure
    then draws what it would have drawn the first time."""
    saved = [(s, None if s.generator is None else s.generator.get_state())
             for s in seqs if s.params.seed is not None]

    def restore() -> None:
        for seq, state in saved:
            if state is None:
                seq.generator = None
            else:
                seq.generator.set_state(state)

    return restore


# --- pure logits processors -----------------------------------------------------------------
def apply_penalties(logits: torch.Tensor, prompt_ids: list[list[int]], output_ids: list[list[int]],
                    repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
                    ) -> torch.Tensor:
    """Repetition (HF: divide positive / multiply negative logits of every token seen in
    prompt or output) and OpenAI presence/frequency (``- p * [c > 0] - f * c`` over
    output counts ``c``)."""
    rows, vocab = logits.shape
    dev = logits.device
    counts = torch.zeros((rows, vocab), dtype=logits.dtype, device=dev)
    seen = torch.zeros((rows, vocab), dtype=torch.bool, device=dev)
    for r in range(rows):
        if output_ids[r]:
            out = torch.tensor(output_ids[r], dtype=torch.long, device=dev)
            counts[r].index_add_(0, out, torch.ones(len(out), dtype=logits.dtype, device=dev))
        if prompt_ids[r]:
            seen[r, torch.tensor(prompt_ids[r], dtype=torch.long, device=dev)] = True
    seen |= counts > 0
    rep = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf what top-k (``k <= 0``: off), top-p (nucleus) and min-p remove."""
    vocab = logits.shape[-1]
    neg_inf = float("-inf")
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kmax = int(k.max())
        top_vals = logits.topk(kmax, dim=-1).values
        threshold = top_vals.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < threshold, neg_inf)
    if bool((top_p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p[:, None]
        drop[:, 0] = False
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, neg_inf))
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        limit = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < limit, neg_inf)
    return logits


def exponential_noise(shape: torch.Size | tuple[int, ...], generator: torch.Generator,
                      device: torch.device) -> torch.Tensor:
    """Exp(1) noise drawn by a CPU ``generator`` and moved to ``device``: the generators
    (seeded per request, or the sampler's shared one) live on the CPU, and CUDA refuses a
    CPU generator; drawn on the CPU, a seed gives the same noise on every device."""
    noise = torch.empty(shape).exponential_(generator=generator)
    return noise if device.type == "cpu" else noise.to(device, non_blocking=True)


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None],
                     shared: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs`` (argmax of p / Exp(1): a draw from p); rows with a
    generator draw from it."""
    if all(g is None for g in generators):
        return (probs / exponential_noise(probs.shape, shared, probs.device)).argmax(dim=-1)
    noise = torch.empty(probs.shape)
    for r, g in enumerate(generators):
        if g is not None:
            noise[r].exponential_(generator=g)
    unseeded = [r for r, g in enumerate(generators) if g is None]
    if unseeded:
        noise[torch.tensor(unseeded)] = torch.empty((len(unseeded), probs.shape[1])).exponential_(
            generator=shared)
    noise = noise if probs.device.type == "cpu" else noise.to(probs.device)
    return (probs / noise).argmax(dim=-1)


# --- the sampler ---------------------------------------------------------------------------
class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def processed_logits(self, logits: torch.Tensor, params: list[SamplingParams],
                         seqs: list[Sequence]) -> torch.Tensor:
        """Penalised logits (greedy rows), or temperature-scaled and filtered (others).
        Every per-row parameter becomes a tensor on the logits' device (CUDA refuses to
        mix a CPU vector into an operation on its tensors)."""
        logits = logits.float()

        def column(values: list) -> torch.Tensor:
            return torch.tensor(values, device=logits.device)

        pen = [r for r, p in enumerate(params) if p.needs_penalties]
        if pen:
            idx = column(pen)
            sub = apply_penalties(
                logits[idx], [seqs[r].token_ids[:seqs[r].num_prompt_tokens] for r in pen],
                [seqs[r].output_token_ids for r in pen],
                column([params[r].repetition_penalty for r in pen]),
                column([params[r].presence_penalty for r in pen]),
                column([params[r].frequency_penalty for r in pen]))
            logits = logits.index_copy(0, idx, sub)
        if all(p.greedy for p in params):
            return logits
        temps = column([p.temperature if not p.greedy else 1.0 for p in params])
        logits = logits / temps[:, None]
        if any(p.needs_filters for p in params):
            logits = filter_logits(
                logits, column([p.top_k for p in params]), column([p.top_p for p in params]),
                column([p.min_p for p in params]))
        return logits

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row (row ``r`` belongs to ``seqs[r]``)."""
        params = [s.params for s in seqs]
        logits = apply_logit_bias(logits, [p.logit_bias for p in params])
        logits = apply_constraints(logits, [s.constraint for s in seqs])
        processed = self.processed_logits(logits, params, seqs)
        greedy = processed.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy.tolist()
        probs = processed.softmax(dim=-1)
        drawn = exponential_race(probs, [generator_for(s) for s in seqs], self.generator)
        mask = torch.tensor([p.greedy for p in params], device=greedy.device)
        return torch.where(mask, greedy, drawn).tolist()

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: list[int], top_n: list[int]) -> list[TokenLogprobs]:
        """Raw log-probabilities of the chosen tokens and each row's top ``n``."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
        vocab = logp.shape[-1]
        kmax = min(max(top_n), vocab)  # a vocabulary smaller than n has only that many
        top_vals, top_ids = (logp.topk(kmax, dim=-1) if kmax else (None, None))
        out = []
        for r, token in enumerate(tokens):
            n = min(top_n[r], vocab)
            top = list(zip(top_ids[r, :n].tolist(), top_vals[r, :n].tolist())) if n else []
            out.append(TokenLogprobs(token, chosen[r], top))
        return out
