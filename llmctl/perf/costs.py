"""FLOPs and bytes of a forward pass, from the architecture and the weight format alone.

Conventions (the ones MFU/MBU are computed with everywhere in llmctl):

- A multiply-add is 2 FLOPs. A token multiplies every matmul weight it passes once:
  ``2 * active_params`` (the linear layers of every block plus the lm_head; the embedding
  is a lookup, not a product). Attention adds, per layer and per key the token attends,
  ``2 * q_heads * head_dim`` for ``Q K^T`` and as much for ``P V``::

      flops_per_token(context) = 2 * active_params + 4 * q_heads * head_dim * sum_l keys_l
      keys_l = min(context, W_l)     (W_l: layer l's sliding window; none: context)

  Norms, RoPE, softmax and activations (O(hidden) per token) are left out.
- Causal prefill: the token at position ``p`` (0-based) attends ``p + 1`` keys. The
  lm_head runs once per sequence: vLLM computes logits for the last prompt token only.
- A decode step reads every matmul weight once, whatever the batch (the embedding table
  is not read except the looked-up rows: a few KB, left out), and each sequence's K and V
  over its whole context; a sliding-window layer holds (vLLM frees the rest) and reads
  only its window's last ``W`` tokens. A mixture of experts reads only the experts its tokens route to:
  with ``n`` tokens routed uniformly to ``k`` of ``E`` experts, ``E * (1 - (1 - k/E)^n)``
  distinct experts per layer (skewed routing touches fewer: an upper bound).
- Activations are not counted as memory traffic: at decode they are KBs per token next to
  GBs of weights; at long prefill they can rival the weights, but prefill is compute-bound
  there, so the verdict does not change.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmctl.perf.arch import ArchSpec
from llmctl.perf.weight_format import NAMED, WeightFormat

__all__ = ["ArchSpec", "ModelCost", "WeightFormat"]


class ModelCost:
    """The cost model of one architecture stored in one weight format, with a KV cache of
    ``kv_bytes`` per element (2 for bf16/fp16, 1 for fp8/int8)."""

    def __init__(self, arch: ArchSpec, weights: WeightFormat | None = None,
                 kv_bytes: float = 2.0) -> None:
        if kv_bytes <= 0:
            raise ValueError(f"kv_bytes must be positive, got {kv_bytes}")
        self.arch = arch
        self.weights = weights if weights is not None else NAMED["bf16"]
        self.kv_bytes = float(kv_bytes)
        self._tally()

    @classmethod
    def from_config(cls, cfg: dict, weights: WeightFormat | None = None,
                    kv_bytes: float = 2.0) -> ModelCost:
        """From a config.json dict; ``weights`` defaults to what the config describes (its
        quantization_config, else 16-bit)."""
        return cls(ArchSpec.from_config(cfg),
                   weights if weights is not None else WeightFormat.from_config(cfg), kv_bytes)

    def _tally(self) -> None:
        """Parameters and stored bytes, layer by layer (an ``ignore`` list may name one
        layer's module: ``model.layers.0.mlp.down_proj``)."""
        a, w = self.arch, self.weights
        per_layer = [a.layer_linears(i) for i in range(a.num_layers)]
        self.layers_params = sum(lin.params for ls in per_layer for lin in ls)
        self.layers_active_params = sum(lin.active_params for ls in per_layer for lin in ls)
        self.lm_head_params = a.vocab_size * a.hidden_size
        self.embedding_params = a.vocab_size * a.hidden_size
        dense_bytes = expert_bytes = 0.0  # over all layers; experts: one copy of each
        for i, linears in enumerate(per_layer):
            for lin in linears:
                name = f"model.layers.{i}." + lin.name.format(e=0)
                size = lin.out_features * lin.in_features * w.linear_bits(
                    name, lin.out_features, lin.in_features) / 8
                if lin.copies > 1:
                    expert_bytes += size
                else:
                    dense_bytes += size
        self._dense_bytes = dense_bytes
        self._expert_bytes = expert_bytes  # one expert of each MoE layer
        head_quantized = w.quantizes("lm_head")
        self.lm_head_bytes = self.lm_head_params * w.linear_bits(
            "lm_head", a.vocab_size, a.hidden_size) / 8
        base = w.base_bits / 8
        # a tied lm_head *is* the embedding table (stored once); a quantized head of a tied
        # model is a second tensor beside the float table vLLM keeps for the lookup
        separate_table = not a.tie_word_embeddings or head_quantized
        self.embedding_bytes = self.embedding_params * base if separate_table else 0.0
        self.vector_bytes = (a.num_layers * a.vector_params_per_layer() + a.hidden_size) * base

    # --- parameters -----------------------------------------------------------------------
    @property
    def matmul_params(self) -> int:
        """Weights of every linear layer plus the lm_head (every expert of a MoE): what a
        dense model's token multiplies. The embedding lookup is not a product."""
        return self.layers_params + self.lm_head_params

    @property
    def active_params(self) -> float:
        """Weights one token multiplies: :attr:`matmul_params` with only ``k`` of ``E``
        experts per MoE layer (equal to it for a dense model)."""
        return self.layers_active_params + self.lm_head_params

    @property
    def total_params(self) -> int:
        """Every stored parameter: linears, lm_head, the embedding unless tied, norms."""
        a = self.arch
        table = 0 if a.tie_word_embeddings else self.embedding_params
        return (self.matmul_params + table + a.num_layers * a.vector_params_per_layer()
                + a.hidden_size)

    # --- FLOPs ------------------------------------------------------------------------------
    @property
    def _attention_flops_per_key(self) -> int:
        """FLOPs of one layer's attention per key one query attends."""
        a = self.arch
        return 4 * a.num_heads * a.head_dim

    def flops_per_token(self, context: int) -> float:
        """``2 * active_params + 4 * q_heads * head_dim * sum_l min(context, W_l)``: one
        token through every product, attending ``context`` keys (itself included) in each
        layer, at most its window in a sliding-window layer."""
        return 2 * self.active_params + self._attention_flops_per_key * self.arch.kv_tokens(
            context)

    def prefill_flops(self, prompt_len: int, cached: int = 0) -> float:
        """Prefill of positions ``cached .. prompt_len-1`` (a cached prefix is skipped):
        ``sum_p [2 * (active - lm_head) + 4 L H d (p + 1)] + 2 * lm_head``, the lm_head
        once (vLLM computes logits for the last prompt token only)."""
        _check_span(prompt_len, cached)
        new = prompt_len - cached
        keys = self.arch.attended_keys(prompt_len, cached)  # sum over layers and p of p + 1
        body = 2 * (self.active_params - self.lm_head_params)
        return body * new + self._attention_flops_per_key * keys + 2 * self.lm_head_params

    def decode_step_flops(self, context_lens: Sequence[int]) -> float:
        """One decode step: one new token per sequence, attending ``context_lens[i]`` keys
        (its context, the new token included)."""
        return sum(self.flops_per_token(c) for c in context_lens)

    # --- bytes -----------------------------------------------------------------------------
    @property
    def weight_bytes(self) -> float:
        """Bytes of the weights as stored (scales and zero points included; a tied
        embedding once; norms and biases at the base precision)."""
        a = self.arch
        experts = self._expert_bytes * (a.num_experts if a.is_moe else 1)
        return (self._dense_bytes + experts + self.lm_head_bytes + self.embedding_bytes
                + self.vector_bytes)

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts per MoE layer ``tokens`` tokens route to (uniform
        routing): ``E * (1 - (1 - k/E)^tokens)``."""
        a = self.arch
        if not a.is_moe:
            return 0.0
        return a.num_experts * (1 - (1 - a.experts_per_token / a.num_experts) ** tokens)

    def weight_bytes_read(self, tokens: int = 1) -> float:
        """Weight bytes one forward step over ``tokens`` tokens reads: every matmul weight
        once (of a MoE, the experts those tokens touch); the embedding rows looked up and
        the norm vectors are left out (negligible)."""
        return self._dense_bytes + self._expert_bytes * self.experts_touched(tokens) \
            + self.lm_head_bytes

    @property
    def weight_bytes_read_per_step(self) -> float:
        """:meth:`weight_bytes_read` of a one-token step (a batch-1 decode step)."""
        return self.weight_bytes_read(1)

    @property
    def kv_bytes_per_layer_token(self) -> float:
        """``2 * kv_heads * head_dim * kv_bytes``: K and V of one token in one layer (GQA
        stores ``kv_heads``, not ``q_heads``)."""
        a = self.arch
        return 2 * a.num_kv_heads * a.head_dim * self.kv_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of one token in every layer: ``2 * layers * kv_heads * head_dim *
        kv_bytes`` (with sliding windows, the cost of a token within every window)."""
        return self.arch.num_layers * self.kv_bytes_per_layer_token

    def sequence_kv_bytes(self, context: int) -> float:
        """K and V one sequence of ``context`` tokens holds: ``sum_l min(context, W_l) *
        2 * kv_heads * head_dim * kv_bytes`` (a window-``W`` layer keeps ``W`` tokens)."""
        return self.arch.kv_tokens(context) * self.kv_bytes_per_layer_token

    def decode_step_bytes(self, context_lens: Sequence[int]) -> float:
        """Weights read once for the whole batch, plus each sequence's K and V over its
        ``context_lens[i]`` tokens (its window's, in a sliding-window layer)."""
        lens = list(context_lens)
        return self.weight_bytes_read(len(lens)) + sum(self.sequence_kv_bytes(c) for c in lens)

    def prefill_bytes(self, prompt_len: int, cached: int = 0) -> float:
        """Weights read once (the experts the new tokens touch), the new tokens' K and V
        written once, a cached prefix's K and V read once (its windows' share)."""
        _check_span(prompt_len, cached)
        new = prompt_len - cached
        return (self.weight_bytes_read(new) + new * self.kv_bytes_per_token
                + self.sequence_kv_bytes(cached))


def _check_span(prompt_len: int, cached: int) -> None:
    if not 0 <= cached < prompt_len:
        raise ValueError(f"need 0 <= cached < prompt_len, got cached={cached}, "
                         f"prompt_len={prompt_len}")
