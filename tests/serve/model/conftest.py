"""Fixtures of the engine's model tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def routed(monkeypatch):
    """Each call of the engine's MoE block records its rows' top-k expert sets (the
    router's bias included: gpt-oss)."""
    from llmctl.models.layers.moe import route
    from llmctl.serve.model import decoder

    calls: list[list[frozenset[int]]] = []
    block = decoder.sparse_moe

    def recording(h, weights, act_mul, *scratch):
        logits = torch.nn.functional.linear(h, weights.router, weights.router_bias)
        calls.append([frozenset(row) for row in route(logits, weights.routing)[1].tolist()])
        return block(h, weights, act_mul, *scratch)

    monkeypatch.setattr(decoder, "sparse_moe", recording)
    return calls
