"""The quantizer's forward of a mixture-of-experts MLP, tap by tap, with per-expert inputs.

The routing is :mod:`llmctl.models.layers.moe`'s (transformers 5's): router logits from the
post-attention norm's output, softmax in float32, top-k, renormalised where the family
does (gpt-oss: the router's bias, top-k logits then their softmax). The router (and Qwen2-MoE's shared-expert sigmoid gate) is read with its float
weights and is never quantized: vLLM loads ``mlp.gate`` / ``block_sparse_moe.gate``
unquantized, and a router whose logits move reroutes tokens.

Each expert is three linears with their own statistics: gate/up read the tokens routed to
the expert (``mlp_in``), down reads ``act(gate) * up`` of those tokens (``mlp_act``;
gpt-oss: the clamped SwiGLU of ``moe.EXPERT_GATES``, each linear with its bias). With
``all_experts`` (``calibrate_all_experts``) every calibration token goes through every
expert *for the statistics only*; the block's output (what the next layer sees) always
uses the real routing, so later layers are calibrated on what the quantized model computes.

The output is the same sum as transformers' grouped experts: each (token, slot) pair's
expert output times its routing weight, laid out ``[T, k, H]`` and summed over the ``k``
slots (the same reduction order, so float32 agrees to the matmuls' last bits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from llmctl.models.layers import activation, gated
from llmctl.models.layers.moe import Routing, expert_gate, route
from llmctl.models.spec import ModelArch

Linear = Callable[[str, torch.Tensor], torch.Tensor]
SHARED = "shared"  # the group key of Qwen2-MoE's shared expert


class ExpertSink(Protocol):
    """Where per-expert calibration inputs go (``stats.ExpertStats``)."""

    def routed(self, group: str, n: int) -> None: ...

    def add(self, group: str, x: torch.Tensor) -> None: ...

    def add_every_expert(self, x: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class MoeShape:
    """One sparse layer's experts: module names (under ``model.layers.{i}.``), widths."""

    routing: Routing
    router: str
    experts: tuple[str, str, str]  # gate, up, down of expert {e}
    width: int
    hidden_act: str = "silu"
    shared: tuple[str, str, str] | None = None
    shared_gate: str | None = None
    shared_width: int = 0
    # gpt-oss's experts: the clamped SwiGLU (moe.EXPERT_GATES) and its constants
    expert_act: str | None = None
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0

    @classmethod
    def per_layer(cls, arch: ModelArch) -> tuple[MoeShape | None, ...]:
        """Every decoder layer's experts (None: a dense layer); () for a dense model."""
        layout = arch.family.moe
        if layout is None or not any(arch.moe_layers):
            return ()
        has_shared = layout.shared is not None and arch.shared_expert_intermediate_size > 0
        shape = cls(Routing.of(arch), layout.router, layout.experts,
                    arch.expert_intermediate_size, arch.hidden_act,
                    layout.shared if has_shared else None,
                    layout.shared_gate if has_shared else None,
                    arch.shared_expert_intermediate_size if has_shared else 0,
                    arch.expert_act, arch.swiglu_alpha, arch.swiglu_limit)
        return tuple(shape if sparse else None for sparse in arch.moe_layers)

    @property
    def num_experts(self) -> int:
        return self.routing.num_experts

    def expert(self, e: int) -> tuple[str, str, str]:
        gate, up, down = (name.format(e=e) for name in self.experts)
        return gate, up, down

    def groups(self, tap: str) -> list[tuple[str, tuple[str, ...]]]:
        """(group, linears) of ``mlp_in`` (gate, up) or ``mlp_act`` (down): one group
        per expert (``expert.{e}``), then the shared expert's."""
        parts = (0, 1) if tap == "mlp_in" else (2,)
        out = [(f"expert.{e}", tuple(self.expert(e)[j] for j in parts))
               for e in range(self.num_experts)]
        if self.shared is not None:
            out.append((SHARED, tuple(self.shared[j] for j in parts)))
        return out

    def act_dim(self, group: str) -> int:
        return self.shared_width if group == SHARED else self.width

    @property
    def full_precision(self) -> tuple[str, ...]:
        return (self.router,) + ((self.shared_gate,) if self.shared_gate else ())


def _routing(x: torch.Tensor, weights: dict[str, torch.Tensor], moe: MoeShape
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing weights, experts), ``[T, k]`` each; the router with its float weights
    (and gpt-oss's bias)."""
    return route(F.linear(x, weights[f"{moe.router}.weight"], weights.get(f"{moe.router}.bias")),
                 moe.routing)


def route_inputs(h: torch.Tensor, weights: dict[str, torch.Tensor], moe: MoeShape,
                 sink: ExpertSink, all_experts: bool) -> None:
    """The ``mlp_in`` tap: each expert's gate/up input (its routed tokens, or every token
    with ``all_experts``), and how many tokens the router sent it."""
    x = h.reshape(-1, h.shape[-1])
    _, experts = _routing(x, weights, moe)
    counts = torch.bincount(experts.reshape(-1), minlength=moe.num_experts).tolist()
    if all_experts:
        sink.add_every_expert(x)
    for e, n in enumerate(counts):
        sink.routed(f"expert.{e}", n)
        if not all_experts and n:
            sink.add(f"expert.{e}", x[(experts == e).any(dim=-1)])
    if moe.shared is not None:
        sink.routed(SHARED, x.shape[0])
        sink.add(SHARED, x)


def moe_forward(h: torch.Tensor, weights: dict[str, torch.Tensor], linear: Linear,
                moe: MoeShape, sink: ExpertSink | None = None, all_experts: bool = False
                ) -> torch.Tensor | None:
    """The mixture's output for ``h`` (the post-attention norm's output, ``[..., H]``),
    with the expert linears applied through ``linear``. With ``sink`` this is the
    ``mlp_act`` tap: each expert's down_proj input goes to the sink (every token's with
    ``all_experts``) and nothing is returned."""
    x = h.reshape(-1, h.shape[-1])
    w, experts = _routing(x, weights, moe)
    act_mul = expert_gate(moe)
    slots = None if sink is not None else torch.zeros(
        *experts.shape, x.shape[-1], dtype=torch.promote_types(x.dtype, w.dtype),
        device=x.device)
    for e in range(moe.num_experts):
        rows, slot = (experts == e).nonzero(as_tuple=True)
        if sink is not None and all_experts:
            rows = torch.arange(x.shape[0], device=x.device)
        if rows.numel() == 0:
            continue
        gate, up, down = moe.expert(e)
        xe = x[rows]
        a = act_mul(linear(gate, xe), linear(up, xe))
        if sink is not None:
            sink.add(f"expert.{e}", a)
            continue
        slots[rows, slot] = linear(down, a) * w[rows, slot].unsqueeze(-1)
    shared = _shared(x, weights, linear, moe, activation(moe.hidden_act), sink)
    if sink is not None:
        return None
    y = slots.sum(dim=1).to(x.dtype)
    if shared is not None:
        y = y + shared
    return y.reshape(h.shape)


def _shared(x: torch.Tensor, weights: dict[str, torch.Tensor], linear: Linear, moe: MoeShape,
            act, sink: ExpertSink | None) -> torch.Tensor | None:
    """Qwen2-MoE's shared expert, gated by ``sigmoid(x . g)`` (g in float, unquantized)."""
    if moe.shared is None:
        return None
    gate, up, down = moe.shared
    a = gated(act, linear(gate, x), linear(up, x))
    if sink is not None:
        sink.add(SHARED, a)
        return None
    return torch.sigmoid(F.linear(x, weights[f"{moe.shared_gate}.weight"])) * linear(down, a)
