"""Full logit rows of a float model (transformers) and of its GGUF (llama.cpp) for the same
windows of token ids: what ``tests/gguf`` and ``benchmarks/gguf_quant_table.py`` compare.

The statistics are eval's: :func:`llmctl.eval.metrics.dense_position_stats` on row i of
a window's logits and token i + 1 of the window, then ``comparison_summary`` (KL(P_float ||
Q_gguf) per position, as llama-perplexity's ``--kl-divergence`` reports it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


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
