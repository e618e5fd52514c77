"""Calibration token windows from any text source (``llmctl.data.sources``).

Documents are tokenized (optionally through the model's chat template, each document as
one user turn, so activations look like the chat traffic an instruct model serves),
joined with eos, and ``samples`` windows of ``seq_len`` tokens are drawn with ``seed``.
The hash covers the exact token ids, so two runs with the same hash saw the same data.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from llmctl.data.sources import load_text_source, sample_windows, token_stream
from llmctl.errors import UsageError

DEFAULT_SOURCE = "builtin:pydoc-calib"


@dataclass(frozen=True)
class CalibrationSpec:
    source: str = DEFAULT_SOURCE
    field: str = "text"
    samples: int = 128
    seq_len: int = 512
    seed: int = 0
    chat_template: bool = False

    def __post_init__(self) -> None:
        if self.samples < 1 or self.seq_len < 2:
            raise UsageError(f"calibration needs samples >= 1 and seq_len >= 2 "
                             f"(got {self.samples} x {self.seq_len})",
                             "pass --samples and --seq-len with positive values")


@dataclass
class CalibrationSet:
    spec: CalibrationSpec
    ids: torch.Tensor  # (samples, seq_len) int64
    source_sha256: str
    documents: int

    @property
    def tokens(self) -> int:
        return self.ids.numel()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.ids.numpy().astype("<i8").tobytes()).hexdigest()

    def to_dict(self) -> dict:
        return {"source": self.spec.source, "field": self.spec.field,
                "samples": self.spec.samples, "seq_len": self.spec.seq_len,
                "seed": self.spec.seed, "chat_template": self.spec.chat_template,
                "documents": self.documents, "tokens": self.tokens,
                "source_sha256": self.source_sha256, "tokens_sha256": self.sha256}


def _chat_stream(tokenizer, texts: list[str]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("the model has no chat template", "drop --chat-template")
    ids: list[int] = []
    for text in texts:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 tokenize=False)
        ids.extend(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return ids


def build_calibration(tokenizer, spec: CalibrationSpec) -> CalibrationSet:
    source = load_text_source(spec.source, spec.field)
    ids = _chat_stream(tokenizer, source.texts) if spec.chat_template else token_stream(tokenizer, source)
    windows = sample_windows(ids, seq_len=spec.seq_len, num=spec.samples, seed=spec.seed)
    return CalibrationSet(spec, torch.tensor(windows, dtype=torch.int64), source.sha256,
                          len(source.texts))
