"""Choosing the next token from one row of logits (numpy): greedy, temperature, top-p.

This is the small sampler of :meth:`Engine.generate` (benchmarks, tests, smoke use).
Served engine directories go through the engine's own sampler instead
(:mod:`llmctl.engines.serve_runner`), with every SamplingParams feature.
"""

from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def sample(logits: np.ndarray, temperature: float, top_p: float,
           rng: np.random.Generator | None) -> int:
    """``temperature == 0``: argmax (lowest id on ties, like torch.argmax)."""
    if temperature == 0.0:
        return int(np.argmax(logits))
    probs = np.exp(log_softmax(logits / temperature))
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        # keep the smallest prefix whose mass reaches top_p (at least one token)
        keep = order[: int(np.searchsorted(cumulative, top_p) + 1)]
        mask = np.zeros_like(probs)
        mask[keep] = probs[keep]
        probs = mask / mask.sum()
    rng = rng or np.random.default_rng()
    return int(rng.choice(len(probs), p=probs))
