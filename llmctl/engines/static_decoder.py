"""A functional Llama-family forward with an explicit KV cache, for torch.export.

The serving engine's forward (:mod:`llmctl.serve.model.decoder`) reads a paged cache through
per-step Python metadata (attention groups, block tables): right for continuous
batching, not exportable as one graph. This one has only tensor inputs::

    forward(input_ids [B, T], start [B], k_cache [L, B, Hkv, C, d], v_cache)
        -> logits [B, T, V], k_new [L, B, Hkv, T, d], v_new

Row ``b`` has ``start[b]`` tokens cached in ``k_cache[:, b, :, :start[b]]`` (the rest of
the ``C`` slots is ignored); its ``T`` new tokens sit at positions ``start[b] + t``. The
new K/V are returned, not written, so the graph is pure and the caller owns the cache
(it writes ``k_new`` at ``start[b]..`` and grows ``C`` in chunks). Query ``t`` sees::

    cache key j   iff  j < start[b]
    new key  s    iff  s <= t          (causal within the chunk)

so right-padded rows (a shorter prompt in a batch) stay exact: their padding is after
every real query. B, T and C are dynamic dimensions of one compiled artifact.

Per layer: ``h = RMSNorm(x)``; ``q, k, v = h W_q, h W_k, h W_v`` (+ biases; qwen3
RMSNorms each q/k head); RoPE at the positions; attention (GQA: each KV head serves
``H / Hkv`` query heads); ``x += W_o attn``; ``x += W_down (act(h W_gate) * h W_up)``.
Each step is a shared building block of :mod:`llmctl.models.layers` (torch's fused
RMSNorm, RoPE in the halves layout, the gated MLP's activation by name).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.models.layers import (
    RMSNorm,
    activation,
    attend,
    gated,
    qk_norm,
    repeat_kv,
    rope_cos_sin,
)
from llmctl.models.layers import rotate_halves as _rope


class StaticDecoder(nn.Module):
    def __init__(self, spec, state_dict: dict[str, torch.Tensor], cos: torch.Tensor,
                 sin: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_layers = spec.num_layers
        self.nh, self.nkv, self.d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.hidden = spec.hidden_size
        self.rms = RMSNorm(spec.rms_norm_eps)  # torch's fused op: one node in the graph
        self.scale = spec.head_dim ** -0.5
        self.qk_norm = spec.qk_norm
        self.act = activation(spec.hidden_act)

        def put(name: str, tensor: torch.Tensor | None) -> None:
            if tensor is not None:
                self.register_buffer(name.replace(".", "_"), tensor.to(dtype).contiguous())

        put("embed", state_dict["model.embed_tokens.weight"])
        put("norm", state_dict["model.norm.weight"])
        head = state_dict.get("lm_head.weight")
        self.tied = spec.tie_word_embeddings or head is None
        if not self.tied:
            put("lm_head", head)
        for i in range(spec.num_layers):
            p = f"model.layers.{i}"
            for part in ("input_layernorm", "post_attention_layernorm"):
                put(f"l{i}.{part}", state_dict[f"{p}.{part}.weight"])
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                put(f"l{i}.{proj}", state_dict[f"{p}.self_attn.{proj}.weight"])
                put(f"l{i}.{proj}_b", state_dict.get(f"{p}.self_attn.{proj}.bias"))
            for proj in ("gate_proj", "up_proj", "down_proj"):
                put(f"l{i}.{proj}", state_dict[f"{p}.mlp.{proj}.weight"])
                put(f"l{i}.{proj}_b", state_dict.get(f"{p}.mlp.{proj}.bias"))
            if spec.qk_norm:
                put(f"l{i}.q_norm", state_dict[f"{p}.self_attn.q_norm.weight"])
                put(f"l{i}.k_norm", state_dict[f"{p}.self_attn.k_norm.weight"])
        put("cos", cos)
        put("sin", sin)

    def _w(self, i: int, name: str) -> torch.Tensor | None:
        return getattr(self, f"l{i}_{name}", None)

    def _linear(self, x: torch.Tensor, i: int, name: str) -> torch.Tensor:
        return F.linear(x, self._w(i, name), self._w(i, f"{name}_b"))

    def forward(self, input_ids: torch.Tensor, start: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t = input_ids.shape
        c = k_cache.shape[3]
        nh, nkv, d = self.nh, self.nkv, self.d
        group = nh // nkv
        pos = start[:, None] + torch.arange(t, device=input_ids.device)[None, :]  # [B, T]
        cos = self.cos[pos].unsqueeze(1)  # [B, 1, T, d]
        sin = self.sin[pos].unsqueeze(1)
        cached = torch.arange(c, device=input_ids.device)[None, None, :] < start[:, None, None]
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        mask = torch.cat([cached.expand(b, t, c), causal[None].expand(b, t, t)], dim=-1)
        mask = mask[:, None]  # [B, 1, T, C + T]
        x = F.embedding(input_ids, self.embed)
        k_out, v_out = [], []
        for i in range(self.num_layers):
            h = self.rms.fused(x, self._w(i, "input_layernorm"))
            q = self._linear(h, i, "q_proj").view(b, t, nh, d).transpose(1, 2)
            k = self._linear(h, i, "k_proj").view(b, t, nkv, d).transpose(1, 2)
            v = self._linear(h, i, "v_proj").view(b, t, nkv, d).transpose(1, 2)
            if self.qk_norm:
                q, k = qk_norm(q, k, self._w(i, "q_norm"), self._w(i, "k_norm"), self.rms,
                               fused=True)
            q = _rope(q, cos, sin)
            k = _rope(k, cos, sin)
            k_out.append(k)
            v_out.append(v)
            keys = repeat_kv(torch.cat([k_cache[i], k], dim=2), group)  # [B, H, C + T, d]
            values = repeat_kv(torch.cat([v_cache[i], v], dim=2), group)
            attn = attend(q, keys, values, mask, scale=self.scale)
            x = x + self._linear(attn.transpose(1, 2).reshape(b, t, nh * d), i, "o_proj")
            h = self.rms.fused(x, self._w(i, "post_attention_layernorm"))
            x = x + self._linear(gated(self.act, self._linear(h, i, "gate_proj"),
                                       self._linear(h, i, "up_proj")), i, "down_proj")
        x = self.rms.fused(x, self.norm)
        logits = F.linear(x, self.embed if self.tied else self.lm_head).float()
        return logits, torch.stack(k_out), torch.stack(v_out)


def build_static_decoder(model_dir, dtype: torch.dtype, max_len: int):
    """(decoder, spec) for a float HF checkpoint directory."""
    from llmctl.errors import UnsupportedArchitectureError
    from llmctl.models.loading import load_model
    from llmctl.serve.model.decoder import ModelSpec

    spec = ModelSpec.from_dir(model_dir)
    window = spec.window_free_len
    if window is not None and max_len > window:
        # this decoder attends fully: exact only while no window has anything to cut
        raise UnsupportedArchitectureError(
            f"{model_dir} attends through a sliding window of {window} tokens; the static "
            f"decoder computes full attention, exact only up to {window}, not {max_len}",
            f"build with --max-seq-len {window}, or serve the checkpoint itself (the paged "
            "engine honours sliding windows)")
    hf = load_model(model_dir, "float32")
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    cos, sin = rope_cos_sin(spec.rope, spec.head_dim, spec.max_position_embeddings, max_len)
    decoder = StaticDecoder(spec, state, cos, sin, dtype).eval()
    del hf, state
    return decoder, spec
