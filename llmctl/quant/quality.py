"""A quick held-out perplexity for quantized checkpoints (benchmarks and slow tests).

Fixed, non-overlapping windows of ``seq_len`` tokens from a text source (by default the
built-in held-out prose, disjoint from the calibration set), no BOS, every token after
the first in a window scored. ``llmctl eval`` is the full tool; this is the yardstick
the quantize benchmarks use so their numbers come from one definition.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from llmctl.data.sources import fixed_windows, load_text_source, token_stream
from llmctl.utils.dtypes import dtype_name

HELDOUT = "builtin:pydoc-heldout"


def heldout_windows(tokenizer, *, source: str = HELDOUT, seq_len: int = 512,
                    max_windows: int = 16) -> torch.Tensor:
    ids = token_stream(tokenizer, load_text_source(source))
    return torch.tensor(fixed_windows(ids, seq_len=seq_len, max_windows=max_windows))


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch: int = 4) -> float:
    """exp(mean next-token negative log-likelihood) over all windows."""
    total, count = 0.0, 0
    for start in range(0, windows.shape[0], batch):
        ids = windows[start:start + batch]
        logits = model(ids).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                ids[:, 1:].reshape(-1), reduction="sum")
        total += float(nll)
        count += ids[:, 1:].numel()
    return math.exp(total / count)


def checkpoint_perplexity(directory: Path, windows: torch.Tensor,
                          dtype: torch.dtype = torch.float32) -> float:
    """Perplexity of a checkpoint as transformers loads it (compressed-tensors included)."""
    from llmctl.models.loading import load_model

    return perplexity(load_model(Path(directory), dtype_name(dtype)), windows)
