"""Which tokens are scored: fixed windows over a token stream, BOS handling, stride.

A window is ``ctx`` consecutive tokens of the stream. The model input is the window,
with the tokenizer's BOS token in front when the tokenizer uses one (``bos='auto'``;
SmolLM2's does not). Row ``r`` of a model's output predicts input token ``r + 1``.

A content token ``j`` (0-based inside its window) is scored when it has context:
``j >= 1`` without BOS, ``j >= 0`` with it, and ``j >= score_from``. With a stride
below ``ctx`` windows overlap and every window after the first scores only the
tokens it adds (``j >= ctx - stride``), so each token is scored once, with at least
``ctx - stride`` tokens of context (the Hugging Face "perplexity of fixed-length
models" recipe).

llama.cpp's ``llama-perplexity`` differs: it *replaces* the first token of each chunk
with BOS and scores only the second half of each chunk. ``score_from=ctx//2`` gives
the same context lengths; the first token is kept rather than overwritten.
The tail of the stream that does not fill a whole window is not scored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmctl.errors import ConfigError


class Windowing(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    ctx: int = Field(512, ge=2, description="tokens per window (without BOS)")
    stride: int | None = Field(None, ge=1, description="window step; default ctx (no overlap)")
    bos: Literal["auto", "always", "never"] = "auto"
    score_from: int = Field(0, ge=0, description="score content tokens j >= score_from only")
    max_windows: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> Windowing:
        if self.stride is not None and self.stride > self.ctx:
            raise ValueError(f"stride {self.stride} is larger than ctx {self.ctx}: tokens would be skipped")
        if self.score_from >= self.ctx:
            raise ValueError(f"score_from {self.score_from} leaves nothing to score in a window of {self.ctx}")
        return self

    @property
    def step(self) -> int:
        return self.stride or self.ctx


@dataclass(frozen=True)
class WindowPlan:
    """Model inputs and, per window, the rows whose next-token prediction is scored."""

    inputs: list[list[int]]
    rows: list[np.ndarray]  # int64 row indices into each window's model output
    bos_id: int | None
    stream_tokens: int

    @property
    def scored_tokens(self) -> int:
        return int(sum(len(r) for r in self.rows))

    def targets(self, w: int) -> np.ndarray:
        """The token each scored row of window ``w`` should predict."""
        return np.asarray(self.inputs[w], dtype=np.int64)[self.rows[w] + 1]


def tokenizer_adds_bos(tokenizer) -> int | None:
    # ``tokenizer`` is a Hugging Face tokenizer or anything called the same way
    # (``tokenizer(text, add_special_tokens=...)["input_ids"]``, ``.bos_token_id``).
    """The BOS id when encoding text puts one in front, else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos if ids and ids[0] == bos else None


def resolve_bos(windowing: Windowing, tokenizer) -> int | None:
    if windowing.bos == "never":
        return None
    if windowing.bos == "always":
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is None:
            raise ConfigError("--bos always, but the tokenizer has no BOS token",
                              "use --bos auto or --bos never")
        return bos
    return tokenizer_adds_bos(tokenizer)


def plan_windows(ids: list[int], windowing: Windowing, bos_id: int | None) -> WindowPlan:
    ctx, step = windowing.ctx, windowing.step
    if len(ids) < ctx:
        raise ConfigError(f"the text has {len(ids)} tokens, fewer than one window of {ctx}",
                          "use more text or a smaller --ctx")
    starts = range(0, len(ids) - ctx + 1, step)
    if windowing.max_windows:
        starts = starts[:windowing.max_windows]
    offset = 1 if bos_id is not None else 0
    first_scored = max(windowing.score_from, 1 - offset)
    inputs, rows = [], []
    for n, start in enumerate(starts):
        window = ids[start:start + ctx]
        inputs.append(([bos_id] if offset else []) + window)
        lowest = first_scored if n == 0 else max(first_scored, ctx - step)
        content = np.arange(lowest, ctx, dtype=np.int64)
        rows.append(content + offset - 1)  # the row that predicts content token j
    return WindowPlan(inputs, rows, bos_id, len(ids))
