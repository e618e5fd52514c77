"""The gated MLP, ``down(act(gate(h)) * up(h))``, with the activation chosen by name.

:data:`ACTIVATIONS` is keyed by the names config.json gives (``hidden_act``, Gemma's
``hidden_activation``; the family row names the key and its default): ``silu`` makes
SwiGLU (Llama, Qwen, Mistral), ``gelu_pytorch_tanh`` GeGLU (Gemma). A new activation is
one entry, computed as transformers' ``ACT2FN`` entry of the same name computes it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from llmctl.models.layers.registry import lookup

Activation = Callable[[torch.Tensor], torch.Tensor]

ACTIVATIONS: dict[str, Activation] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}


def activation(name: str) -> Activation:
    """The activation named ``name``; an unknown name raises with the known ones."""
    return lookup(ACTIVATIONS, name, "MLP activation")


def gated(act: Activation, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation, the input of ``down_proj``: ``act(gate) * up``."""
    return act(gate) * up


def fused_gated(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``gate_up -> act(gate) * up`` for the fused ``[gate | up]`` projection's output."""
    act = activation(name)

    def act_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up

    return act_mul
