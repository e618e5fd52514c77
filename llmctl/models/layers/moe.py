"""The sparse mixture-of-experts block: routing, the grouped expert computation, the
weighted combine and Qwen2-MoE's gated shared expert, as transformers 5 computes them.

For the ``T`` tokens ``x [T, H]`` of a step, with ``E`` experts of width ``I``::

    logits = x @ W_router^T                                    # [T, E]
    p = softmax(logits) in float32;  w, e = top_k(p)           # [T, k] each
    w = w / sum(w)                 (Mixtral always; Qwen when norm_topk_prob)
    y_t = sum_j  w_tj * down_e(act(gate_e(x_t)) * up_e(x_t))   with e = e_tj
    y_t += sigmoid(x_t . g) * shared(x_t)                      (Qwen2-MoE)

gpt-oss (``Routing.order == "topk_softmax"``) routes the other way round: the router has
a bias, ``l, e = top_k(x @ W_router^T + b)`` and ``w = softmax(l)`` over those ``k`` only,
in the logits' dtype. Its experts have biases (``gate_up_bias [E, 2I]``, ``down_bias
[E, H]``), their gate/up product's columns are interleaved (gate ``[..., ::2]``, up
``[..., 1::2]``) and their activation is the clamped SwiGLU of :data:`EXPERT_ACTS`
(``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``, ``(up + 1) * gate *
sigmoid(alpha * gate)``), as transformers' ``GptOssExperts`` computes them.

The grouped computation is transformers' default (``grouped_mm`` experts): the ``T * k``
(token, expert) pairs sorted by expert, each expert's gated MLP on its own rows only (one
pair of products per expert that any token picked; the others are never read), the rows
scaled by their routing weight, put back in token order and summed over the ``k`` slots
of each token (``[T, k, H].sum(1)``: the same reduction, so float32 agrees to the last
bits of the matmuls). Mixtral keeps the routing weights in float32 (its products and sum
then run in float32 for bfloat16 weights); Qwen casts them to the logits' dtype first.

Pure functions of tensors: the engine (:mod:`llmctl.serve.model.decoder`), the quantizer
and the reference forwards share them. Expert weights are stacked: ``gate_up [E, 2I, H]``
(gate rows, then up rows, transformers 5's ``experts.gate_up_proj``) and
``down [E, H, I]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from llmctl.models.layers.mlp import activation, fused_gated, gated
from llmctl.models.layers.registry import lookup
from llmctl.models.layers.scratch import Scratch
from llmctl.models.spec import ModelArch

# ``[T, 2I] -> [T, I]``: act(gate) * up on a fused gate/up product (mlp.fused_gated)
ActMul = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Routing:
    """How a family turns router logits into ``k`` experts and their weights."""

    num_experts: int
    top_k: int
    normalize: bool  # renormalise the top-k probabilities to sum 1
    float32_weights: bool  # keep the weights float32 (Mixtral), else the logits' dtype
    # "softmax_topk" (Mixtral, Qwen) or "topk_softmax" (gpt-oss): spec.MoeLayout.routing
    order: str = "softmax_topk"

    @classmethod
    def of(cls, arch: ModelArch) -> Routing:
        moe = arch.family.moe
        if moe is None:
            raise ValueError(f"{arch.model_type} is not a mixture of experts")
        return cls(arch.num_experts, arch.experts_per_token, arch.norm_topk_prob,
                   moe.float32_weights, moe.routing)


def route(logits: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k], experts [T, k])`` of router ``logits [T, E]``: the softmax over
    all ``E`` in float32, its ``k`` largest (in descending order, as ``torch.topk``
    returns them), renormalised where the family does; gpt-oss's ``topk_softmax``: the
    ``k`` largest logits, then the softmax over them in the logits' dtype."""
    if routing.order == "topk_softmax":
        top, experts = torch.topk(logits, routing.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), experts
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, routing.top_k, dim=-1)
    if routing.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not routing.float32_weights:
        weights = weights.to(logits.dtype)
    return weights, experts


def clamped_glu(gate: torch.Tensor, up: torch.Tensor, alpha: float,
                limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of the gate and up outputs (transformers'
    ``GptOssExperts._apply_gate``, the same ops in the same order)."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def clamped_swiglu(alpha: float, limit: float) -> ActMul:
    """:func:`clamped_glu` on the interleaved gate/up product ``[T, 2I] -> [T, I]``."""
    def act_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return clamped_glu(gate_up[..., ::2], gate_up[..., 1::2], alpha, limit)

    return act_mul


# the experts' activations that are not a family's gated MLP (ModelArch.expert_act):
# name -> (alpha, limit) -> act_mul on the fused product, and -> (gate, up) -> act on
# the two outputs apart (the quantizer's per-expert linears)
EXPERT_ACTS: dict[str, Callable[[float, float], ActMul]] = {"clamped_swiglu": clamped_swiglu}
GateUp = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
EXPERT_GATES: dict[str, Callable[[float, float], GateUp]] = {
    "clamped_swiglu": lambda alpha, limit: partial(clamped_glu, alpha=alpha, limit=limit)}


def expert_gate(spec) -> GateUp:
    """``(gate, up) -> act(gate) * up`` of the experts of a ``ModelArch`` (or a shape with
    its ``hidden_act``, ``expert_act``, ``swiglu_alpha``, ``swiglu_limit``): gpt-oss's
    clamped SwiGLU, else the gated MLP of ``hidden_act``."""
    if spec.expert_act:
        return lookup(EXPERT_GATES, spec.expert_act, "expert activation")(
            spec.swiglu_alpha, spec.swiglu_limit)
    return partial(gated, activation(spec.hidden_act))


def expert_act_mul(spec) -> ActMul:
    """The experts' ``act(gate) * up`` of a ``ModelArch`` (or the engine's ``ModelSpec``,
    which shares the fields): :data:`EXPERT_ACTS` where ``expert_act`` names one, else the
    gated MLP of ``hidden_act``."""
    if spec.expert_act:
        return lookup(EXPERT_ACTS, spec.expert_act, "expert activation")(
            spec.swiglu_alpha, spec.swiglu_limit)
    return fused_gated(spec.hidden_act)


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                    gate_up: Experts, down: Experts, act_mul: ActMul,
                    gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None,
                    scratch: Scratch | None = None) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{experts[t, j]}(x_t)`` for every token (module doc):
    the (token, slot) pairs sorted by expert, each picked expert's MLP on its rows only
    (with gpt-oss's per-expert biases ``gate_up_bias [E, 2I]``, ``down_bias [E, H]``).
    ``gate_up``/``down``: the stacked weights, or one linear per expert (a callable on
    ``[rows, in]`` with its bias inside: the engine's native bf16 or low-bit kernels), in
    expert order. ``scratch``: where the four ``[T * k, H]`` buffers come from (the
    engine's, reused step after step: :mod:`llmctl.models.layers.scratch`); None
    allocates them."""
    t, k = experts.shape
    h_size = x.shape[-1]

    def buffer(name: str, dtype: torch.dtype) -> torch.Tensor:
        if scratch is None:
            return torch.empty(t * k, h_size, dtype=dtype, device=x.device)
        return scratch.take(name, (t * k, h_size), dtype, x.device)

    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # one host sync for the group sizes, as transformers' grouped fallback does
    counts = torch.bincount(flat, minlength=len(gate_up)).tolist()
    rows = torch.index_select(x, 0, order // k, out=buffer("rows", x.dtype))  # p's token: p // k
    stacked = isinstance(gate_up, torch.Tensor)
    out = buffer("out", gate_up.dtype if stacked else x.dtype)
    start = 0
    for e, n in enumerate(counts):
        if n:
            seg = rows[start:start + n]
            if stacked:
                h = F.linear(seg.to(gate_up.dtype), gate_up[e],
                             None if gate_up_bias is None else gate_up_bias[e])
                out[start:start + n] = F.linear(act_mul(h), down[e],
                                                None if down_bias is None else down_bias[e])
            else:  # the engine's own per-expert linears (biases inside)
                out[start:start + n] = down[e](act_mul(gate_up[e](seg)))
            start += n
    scale = weights.reshape(-1)[order].unsqueeze(-1)
    weighted = torch.mul(out, scale, out=buffer("weighted", torch.promote_types(
        out.dtype, scale.dtype)))
    # back to (token, slot) order: gather by the inverse permutation (pair p went to
    # inverse[p]), the same values as scattering by ``order``
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    unsorted = torch.index_select(weighted, 0, inverse, out=buffer("unsorted", weighted.dtype))
    return unsorted.view(t, k, -1).sum(dim=1).to(x.dtype)


# the stacked weights [E, out, in], or one callable linear per expert (bias inside)
Experts = torch.Tensor | Sequence[Callable[[torch.Tensor], torch.Tensor]]


def _bytes(part) -> int:
    """A stacked tensor's bytes, or the sum of the per-expert linears' ``nbytes`` (what
    each reads: a low-bit expert's codes, scales and bias, not a bf16 equivalent)."""
    if isinstance(part, torch.Tensor):
        return part.numel() * part.element_size()
    return sum(linear.nbytes for linear in part)


@dataclass
class MoeWeights:
    """One layer's mixture of experts: the router, the stacked experts and the optional
    shared expert (``shared_gate_up [2S, H]``, ``shared_down [H, S]``, its sigmoid gate
    ``shared_gate [1, H]``)."""

    router: torch.Tensor  # [E, H]
    gate_up: Experts  # [E, 2I, H]
    down: Experts  # [E, H, I]
    routing: Routing
    shared_gate_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None
    # gpt-oss: the router's bias [E] and the experts' biases [E, 2I], [E, H]
    router_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    def _parts(self) -> list:
        return [p for p in (self.router, self.router_bias, self.shared_gate_up,
                            self.shared_down, self.shared_gate) if p is not None]

    def _experts(self) -> list:
        return [p for p in (self.gate_up, self.down, self.gate_up_bias, self.down_bias)
                if p is not None]

    @property
    def nbytes(self) -> int:
        return sum(_bytes(p) for p in self._parts() + self._experts())

    @property
    def active_nbytes(self) -> int:
        """The bytes one token reads: the router, ``k`` of the ``E`` experts and the
        shared expert: ``nbytes - (E - k) / E * experts' bytes``."""
        experts = sum(_bytes(p) for p in self._experts())
        idle = experts * (self.routing.num_experts - self.routing.top_k) // \
            self.routing.num_experts
        return self.nbytes - idle


def sparse_moe(x: torch.Tensor, w: MoeWeights, act_mul: ActMul,
               scratch: Scratch | None = None) -> torch.Tensor:
    """The block's output for ``x [T, H]`` (module doc), in ``x``'s dtype; ``scratch``:
    :func:`grouped_experts`'."""
    weights, experts = route(F.linear(x, w.router, w.router_bias), w.routing)
    y = grouped_experts(x, weights, experts, w.gate_up, w.down, act_mul, w.gate_up_bias,
                        w.down_bias, scratch)
    if w.shared_gate_up is not None:
        shared = F.linear(act_mul(F.linear(x, w.shared_gate_up)), w.shared_down)
        y = y + torch.sigmoid(F.linear(x, w.shared_gate)) * shared
    return y


def moe_block(x: torch.Tensor, w: MoeWeights, activation: str = "silu") -> torch.Tensor:
    """:func:`sparse_moe` with the activation by its config.json name."""
    return sparse_moe(x, w, fused_gated(activation))
