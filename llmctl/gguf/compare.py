"""How far a GGUF's llama.cpp outputs are from the float model's transformers outputs.

Pure maths (:func:`log_softmax`, :func:`kl_divergence`, :func:`token_stats`) plus two
thin runners: transformers logits for windows of token ids, and llama.cpp logits for
the same windows. KL(P_float || Q_gguf) per token position, as llama-perplexity's
``--kl-divergence`` reports it (mean, percentiles, same-top-token rate).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_divergence(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """Per-row KL(softmax(reference) || softmax(candidate)) in nats."""
    p_log, q_log = log_softmax(reference), log_softmax(candidate)
    return (np.exp(p_log) * (p_log - q_log)).sum(axis=-1)


def nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Per-row negative log-likelihood of ``targets`` (logits row i predicts target i)."""
    return -log_softmax(logits)[np.arange(len(targets)), targets]


@dataclass(frozen=True)
class TokenStats:
    tokens: int
    mean_kld: float
    median_kld: float
    p99_kld: float
    max_kld: float
    same_top1: float  # fraction of positions whose argmax agrees
    ppl: float  # of the candidate on the next tokens
    ppl_reference: float

    def to_dict(self) -> dict:
        return asdict(self)


def token_stats(reference: list[np.ndarray], candidate: list[np.ndarray],
                windows: list[list[int]]) -> TokenStats:
    """KLD and perplexity over windows; position i's logits predict token i + 1."""
    klds, nll_c, nll_r, same = [], [], [], []
    for ref, cand, ids in zip(reference, candidate, windows):
        ref, cand = ref[:-1], cand[:-1]
        targets = np.asarray(ids[1:])
        klds.append(kl_divergence(ref, cand))
        nll_c.append(nll(cand, targets))
        nll_r.append(nll(ref, targets))
        same.append(ref.argmax(-1) == cand.argmax(-1))
    kld = np.concatenate(klds)
    return TokenStats(
        tokens=int(kld.size),
        mean_kld=float(kld.mean()),
        median_kld=float(np.median(kld)),
        p99_kld=float(np.percentile(kld, 99)),
        max_kld=float(kld.max()),
        same_top1=float(np.concatenate(same).mean()),
        ppl=float(np.exp(np.concatenate(nll_c).mean())),
        ppl_reference=float(np.exp(np.concatenate(nll_r).mean())),
    )


def transformers_logits(model_dir: Path, windows: list[list[int]]) -> list[np.ndarray]:
    import torch

    from llmctl.models.loading import load_model

    model = load_model(model_dir, "float32")
    out = []
    with torch.inference_mode():
        for ids in windows:
            out.append(model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy())
    return out


def llamacpp_logits(gguf_path: Path, windows: list[list[int]], threads: int | None = None
                    ) -> list[np.ndarray]:
    from llmctl.gguf.llamacpp import LlamaCppModel

    n_ctx = max(len(w) for w in windows)
    with LlamaCppModel(gguf_path, n_ctx=n_ctx, threads=threads) as model:
        return [model.logits(ids) for ids in windows]


def heldout_windows(model_dir: Path, *, source: str = "builtin:pydoc-heldout",
                    seq_len: int = 256, count: int = 4) -> list[list[int]]:
    """The first ``count`` consecutive windows of held-out text, tokenized by HF."""
    from llmctl.data.sources import fixed_windows, load_text_source, token_stream
    from llmctl.models.loading import load_tokenizer

    ids = token_stream(load_tokenizer(model_dir), load_text_source(source))
    return fixed_windows(ids, seq_len=seq_len, max_windows=count)
