"""Router agreement: does a candidate (a quantized mixture of experts) send each token to
the experts its reference sends it to?

KLD and perplexity average over a token's whole output, so a quantization that moves a
few tokens to other experts in a middle layer can leave them nearly unchanged while the
model computes something else for those tokens. The check is direct: for every MoE layer,
the share of tokens whose top-k expert *set* is the same in both models (the order within
the set does not matter: the combine is a weighted sum), on the same windows of the eval
text. A layer's router sees its layer's input, so a disagreement in an early layer also
shows in later ones; the minimum over layers is the gate metric.

Both models run through transformers (``output_router_logits``: each MoE layer's router
logits, ``[tokens, experts]``); the top-k of the logits is the top-k of the softmax
transformers routes by. Ties are broken by ``torch.topk`` identically on both sides.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

# Windows of the eval text whose routing is compared (both models run them once more):
# a bound on the extra cost, enough tokens for the share's noise to be small
# (8 windows of 512 tokens: a standard error under 0.003 at 0.99 agreement).
ROUTING_WINDOWS = 8
METRICS = ("router_agreement_min", "router_agreement_mean")


def top_k_sets(router_logits: Sequence[Any], k: int) -> np.ndarray:
    """``[layers, tokens, k]`` expert ids, sorted within each set, from each layer's
    ``[tokens, experts]`` router logits."""
    import torch

    sets = [torch.topk(logits.float(), k, dim=-1).indices.sort(dim=-1).values.numpy()
            for logits in router_logits]
    return np.stack(sets).astype(np.int32)


def agreement(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """Per layer, the share of tokens whose top-k set is the same in both."""
    if reference.shape != candidate.shape:
        raise ValueError(f"routes of shape {candidate.shape} against {reference.shape}: "
                         "not the same model layout or text")
    return (reference == candidate).all(axis=-1).mean(axis=-1)


def summary(per_layer: np.ndarray) -> dict[str, float]:
    return {"router_agreement_min": float(per_layer.min()),
            "router_agreement_mean": float(per_layer.mean())}


def experts_per_token(path: Path) -> int | None:
    """``num_experts_per_tok`` of a checkpoint whose family is a mixture of experts, else
    None (a dense model, or no config to read)."""
    from llmctl.models.spec import FAMILIES, text_config

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    config = text_config(json.loads(config_file.read_text()))
    row = FAMILIES.get(config.get("model_type", ""))
    if row is None or row.moe is None:
        return None
    return int(config["num_experts_per_tok"])


def model_routes(model, windows: Sequence[Sequence[int]], k: int) -> np.ndarray:
    """A transformers MoE model's top-k sets over ``windows`` (token ids), concatenated
    along the tokens: ``[moe layers, tokens, k]``."""
    import torch

    parts = []
    with torch.inference_mode():
        for ids in windows:
            out = model(torch.tensor([list(ids)]), output_router_logits=True)
            parts.append(top_k_sets(out.router_logits, k))
    return np.concatenate(parts, axis=1)
