"""A functional decoder forward with an explicit KV cache, for torch.export: every family
the serving engine runs.

The serving engine's forward (:mod:`llmctl.serve.model.decoder`) reads a paged cache through
per-step Python metadata (attention groups, block tables): right for continuous
batching, not exportable as one graph. This one has only tensor inputs::

    forward(input_ids [B, T], start [B], k_cache [L, B, Hkv, C, d], v_cache)
        -> logits [B, T, V], k_new [L, B, Hkv, T, d], v_new

Row ``b`` has ``start[b]`` tokens cached in ``k_cache[:, b, :, :start[b]]`` (the rest of
the ``C`` slots is ignored); its ``T`` new tokens sit at positions ``start[b] + t``. The
new K/V are returned, not written, so the graph is pure and the caller owns the cache
(it writes ``k_new`` at ``start[b]..`` and grows ``C`` in chunks). Query ``t`` at position
``p`` sees::

    cache key j   iff  j < start[b]
    new key  s    iff  s <= t          (causal within the chunk)
    and, in a layer with a sliding window W, only keys at positions > p - W

so right-padded rows (a shorter prompt in a batch) stay exact: their padding is after
every real query. B, T and C are dynamic dimensions of one compiled artifact; the
windows are constants of the graph (one mask per distinct window).

Per layer, the family's form as data (:class:`llmctl.serve.model.decoder.ModelSpec`, read
from :data:`llmctl.models.spec.FAMILIES`)::

    h = norm_input(x)              (OLMo 2 has none: h = x)
    q, k, v = split(h W_qkv + b)   (Phi-3 stores W_qkv fused; the others are concatenated)
    q, k = qk_norm(q), qk_norm(k)  (per head: Qwen3, Gemma 3; whole projection: OLMo 2)
    q, k = RoPE(q), RoPE(k)        (the layer's table: Gemma 3's sliding layers their own;
                                    partial rotary: the first rotary_dim dims of a head)
    a = attention(q, k, v)         (GQA; score scale; Gemma 2's soft-cap; the window)
    x += res_mult * norm_attn_out(a W_o)     (Gemma 2/3, OLMo 2 norm the branch)
    h = norm_mlp_in(x)
    x += res_mult * norm_mlp_out(W_down act(gate) * up)

with ``x = embed(ids) * embedding_multiplier`` (Gemma: sqrt(hidden) rounded to the dtype)
and ``logits = softcap(lm_head(norm(x)) / logits_scaling)``. Each step is a shared building
block of :mod:`llmctl.models.layers` (torch's fused RMSNorm with Gemma's ``1 + w`` folded in
at load, RoPE in the halves layout, the gated MLP's activation by name, attention with its
score hooks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.models.layers import activation, attend, gated, repeat_kv, rope_cos_sin
from llmctl.models.layers import rotate_halves as _rope
from llmctl.models.spec import FUSED_PARTS, NORM_LAYOUTS

# the fused projections the decoder computes, and the checkpoint's parts of each
QKV, GATE_UP = "self_attn.qkv_proj", "mlp.gate_up_proj"


def _fused(state: dict[str, torch.Tensor], prefix: str, fused: str,
           suffix: str) -> torch.Tensor | None:
    """``{prefix}.{fused}.{suffix}`` as stored (Phi-3), else its parts' rows concatenated
    (None when the parts have no such tensor: no biases)."""
    whole = state.get(f"{prefix}.{fused}.{suffix}")
    if whole is not None:
        return whole
    parts = [state.get(f"{prefix}.{part}.{suffix}") for part in FUSED_PARTS[fused]]
    if all(p is None for p in parts):
        return None
    return torch.cat(parts, dim=0)


class StaticDecoder(nn.Module):
    def __init__(self, spec, state_dict: dict[str, torch.Tensor],
                 tables: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 dtype: torch.dtype) -> None:
        """``tables``: RoPE cos/sin by name, ``"global"`` and, where the sliding layers
        rotate with their own (Gemma 3), ``"local"``."""
        super().__init__()
        self.num_layers = spec.num_layers
        self.nh, self.nkv, self.d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.hidden = spec.hidden_size
        self.eps = spec.rms_norm_eps
        self.scale = spec.attention_scale or spec.head_dim ** -0.5
        self.attn_softcap = spec.attn_softcap
        self.final_softcap = spec.final_softcap
        self.residual_multiplier = spec.residual_multiplier
        self.logits_scaling = spec.logits_scaling
        self.qk_norm_over = spec.qk_norm_over if spec.qk_norm else None
        self.act = activation(spec.hidden_act)
        self.slots = tuple(NORM_LAYOUTS[spec.norms])
        self.windows = tuple(spec.layer_windows) or (None,) * spec.num_layers
        local = "local" in tables
        self.layer_table = tuple("local" if w and local else "global" for w in self.windows)
        offset = spec.norm_offset

        def put(name: str, tensor: torch.Tensor | None, plus: float = 0.0) -> None:
            if tensor is not None:  # norm weights: Gemma's (1 + w) folded in, in float32
                value = tensor.float() + plus if plus else tensor
                self.register_buffer(name.replace(".", "_"), value.to(dtype).contiguous())

        put("embed", state_dict["model.embed_tokens.weight"])
        put("norm", state_dict["model.norm.weight"], offset)
        head = state_dict.get("lm_head.weight")
        self.tied = spec.tie_word_embeddings or head is None
        if not self.tied:
            put("lm_head", head)
        if spec.embedding_multiplier != 1.0:  # Gemma rounds sqrt(hidden) to the dtype
            self.register_buffer("embed_scale", torch.tensor(spec.embedding_multiplier,
                                                             dtype=dtype))
        else:
            self.embed_scale = None
        for i in range(spec.num_layers):
            p = f"model.layers.{i}"
            for slot, module in NORM_LAYOUTS[spec.norms].items():
                put(f"l{i}.{slot}", state_dict[f"{p}.{module}.weight"], offset)
            for fused, name in ((QKV, "qkv"), (GATE_UP, "gate_up")):
                put(f"l{i}.{name}", _fused(state_dict, p, fused, "weight"))
                put(f"l{i}.{name}_b", _fused(state_dict, p, fused, "bias"))
            for module, name in (("self_attn.o_proj", "o"), ("mlp.down_proj", "down")):
                put(f"l{i}.{name}", state_dict[f"{p}.{module}.weight"])
                put(f"l{i}.{name}_b", state_dict.get(f"{p}.{module}.bias"))
            if spec.qk_norm:
                put(f"l{i}.q_norm", state_dict[f"{p}.self_attn.q_norm.weight"], offset)
                put(f"l{i}.k_norm", state_dict[f"{p}.self_attn.k_norm.weight"], offset)
        for name, (cos, sin) in tables.items():
            put(f"{name}.cos", cos)
            put(f"{name}.sin", sin)

    def _w(self, i: int, name: str) -> torch.Tensor | None:
        return getattr(self, f"l{i}_{name}", None)

    def _linear(self, x: torch.Tensor, i: int, name: str) -> torch.Tensor:
        return F.linear(x, self._w(i, name), self._w(i, f"{name}_b"))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """torch's fused RMSNorm over the last dimension; no weight: no norm (the slot is
        not in the family's layout)."""
        return x if weight is None else F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def _branch(self, y: torch.Tensor, i: int, slot: str) -> torch.Tensor:
        """A branch's output as the residual add takes it: normed after (Gemma 2/3,
        OLMo 2), times the residual multiplier (Granite)."""
        y = self._norm(y, self._w(i, slot))
        return y if self.residual_multiplier == 1.0 else y * self.residual_multiplier

    def _masks(self, start: torch.Tensor, pos: torch.Tensor, c: int
               ) -> dict[int | None, torch.Tensor]:
        """``[B, 1, T, C + T]`` bool (True: attend) per distinct window (None: full)."""
        b, t = pos.shape
        device = pos.device
        slots = torch.arange(c, device=device)
        cached = slots[None, None, :] < start[:, None, None]
        causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        full = torch.cat([cached.expand(b, t, c), causal[None].expand(b, t, t)], dim=-1)
        key_pos = torch.cat([slots[None].expand(b, c), pos], dim=1)  # [B, C + T]
        masks = {None: full[:, None]}
        for w in sorted({w for w in self.windows if w is not None}):
            near = key_pos[:, None, :] > pos[:, :, None] - w
            masks[w] = (full & near)[:, None]
        return masks

    def _qkv(self, h: torch.Tensor, i: int) -> tuple[torch.Tensor, ...]:
        """q ``[B, H, T, d]``, k and v ``[B, Hkv, T, d]``, q and k normed where the family
        norms them (before RoPE)."""
        b, t, _ = h.shape
        nh, nkv, d = self.nh, self.nkv, self.d
        q, k, v = self._linear(h, i, "qkv").split([nh * d, nkv * d, nkv * d], dim=-1)
        if self.qk_norm_over == "projection":  # OLMo 2: over the whole q and k
            q, k = self._norm(q, self._w(i, "q_norm")), self._norm(k, self._w(i, "k_norm"))
        q, k, v = q.view(b, t, nh, d), k.view(b, t, nkv, d), v.view(b, t, nkv, d)
        if self.qk_norm_over == "head":  # Qwen3, Gemma 3: each head's vector
            q, k = self._norm(q, self._w(i, "q_norm")), self._norm(k, self._w(i, "k_norm"))
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, input_ids: torch.Tensor, start: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t = input_ids.shape
        nh, d = self.nh, self.d
        group = nh // self.nkv
        pos = start[:, None] + torch.arange(t, device=input_ids.device)[None, :]  # [B, T]
        rope = {name: (getattr(self, f"{name}_cos")[pos].unsqueeze(1),  # [B, 1, T, rot]
                       getattr(self, f"{name}_sin")[pos].unsqueeze(1))
                for name in set(self.layer_table)}
        masks = self._masks(start, pos, k_cache.shape[3])
        x = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        k_out, v_out = [], []
        for i in range(self.num_layers):
            q, k, v = self._qkv(self._norm(x, self._w(i, "input")), i)
            cos, sin = rope[self.layer_table[i]]
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            k_out.append(k)
            v_out.append(v)
            keys = repeat_kv(torch.cat([k_cache[i], k], dim=2), group)  # [B, H, C + T, d]
            values = repeat_kv(torch.cat([v_cache[i], v], dim=2), group)
            attn = attend(q, keys, values, masks[self.windows[i]], scale=self.scale,
                          softcap=self.attn_softcap)
            o = self._linear(attn.transpose(1, 2).reshape(b, t, nh * d), i, "o")
            x = x + self._branch(o, i, "attn_out")
            h = self._norm(x, self._w(i, "mlp_in"))
            gate, up = self._linear(h, i, "gate_up").chunk(2, dim=-1)
            x = x + self._branch(self._linear(gated(self.act, gate, up), i, "down"), i,
                                 "mlp_out")
        return self._logits(x), torch.stack(k_out), torch.stack(v_out)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits: divided by Granite's ``logits_scaling``, soft-capped as Gemma 2
        caps them (``cap * tanh(logits / cap)``)."""
        logits = F.linear(self._norm(x, self.norm), self.embed if self.tied
                          else self.lm_head).float()
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        cap = self.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap


def rope_tables(spec, max_len: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """cos/sin ``[max_len, rotary_dim]`` of the model's RoPE, and of its sliding layers'
    own where they have one (Gemma 3). A LongRoPE table past the original context uses the
    long factors for every position (the engine's choice, see :mod:`llmctl.models.layers.rope`)."""
    def table(params: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(params, spec.head_dim, spec.max_position_embeddings, max_len,
                            partial=spec.partial_rotary_factor)

    tables = {"global": table(spec.rope)}
    if spec.local_rope is not None:
        tables["local"] = table(spec.local_rope)
    return tables


def build_static_decoder(model_dir, dtype: torch.dtype, max_len: int):
    """(decoder, spec) for a float HF checkpoint directory of any family the engine runs
    (:class:`~llmctl.serve.model.decoder.ModelSpec` refuses the others, naming them)."""
    from llmctl.models.loading import load_model
    from llmctl.serve.model.decoder import ModelSpec

    spec = ModelSpec.from_dir(model_dir)
    hf = load_model(model_dir, "float32")
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    decoder = StaticDecoder(spec, state, rope_tables(spec, max_len), dtype).eval()
    del hf, state
    return decoder, spec
