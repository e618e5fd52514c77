"""The Llama-family forward pass, written for the paged KV cache.

One decoder covers every family of the table: they differ in data, not code
(their rows of :data:`llmctl.models.spec.FAMILIES`, read into
:class:`llmctl.models.spec.ModelArch`): qkv biases (qwen2 always, llama/qwen3 when
``attention_bias``), an RMSNorm over each head of q and k before RoPE (qwen3), tied embeddings, and which
layers attend through a sliding window (``llmctl.models.windows.WINDOW_RULES``, as transformers reads the
config: mistral's ``sliding_window`` covers every layer; qwen2/qwen3 window only with
``use_sliding_window``, the layers ``layer_types`` names "sliding_attention", by default
those with index >= ``max_window_layers``). A windowed layer's query at position ``p``
sees keys ``p - W + 1 .. p`` (transformers' ``kv_idx > q_idx - sliding_window``).

Per layer, for the flat stream of this step's ``T`` tokens::

    h = RMSNorm(x);  q, k, v = split(h @ W_qkv)            # fused q/k/v projection
    q, k = RoPE(q), RoPE(k) at each token's position;  cache[slot] = k, v
    x = x + W_o · attention(q, cache via block tables)      # GQA, causal (windowed)
    h = RMSNorm(x);  g, u = split(h @ W_gate_up)            # fused gate/up
    x = x + W_down · (silu(g) * u)                          # SwiGLU

A mixture-of-experts layer (Mixtral, Qwen2/3-MoE, gpt-oss: ``ModelSpec.moe_layers``)
replaces the last line by the block of :mod:`llmctl.models.layers.moe` (routing, each
picked expert's SwiGLU on its tokens only, the weighted sum, Qwen2-MoE's gated shared
expert, gpt-oss's biased experts and clamped SwiGLU), on the torch path: the fused native
decode layers refuse such a model. gpt-oss's attention sinks (``ModelSpec.attn_sinks``,
``Layer.sinks``) go to :func:`llmctl.serve.layers.attention.paged_attention`, which hands
them to the native attention kernels or computes them on its torch path.

RMSNorm: ``x / sqrt(mean(x^2) + eps) * w``. The torch path is the shared building blocks
of :mod:`llmctl.models.layers` (RMSNorm, RoPE, the gated MLP); the native kernels of
:mod:`llmctl.serve.kernels` (fused norm + residual, SwiGLU, RoPE + cache write, the fused
decode layers) are the engine's own fast paths. Weights are plain tensors and small
callable linears (dense or low-bit, :mod:`llmctl.serve.layers.quant_linear`), not
``nn.Module``s: on CPU the per-call overhead of modules is a measurable share of a decode
step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from llmctl.models.architectures import get_architecture
from llmctl.models.layers import (
    activation,
    add_rms_norm,
    fused_gated,
    fused_rms_norm,
    sparse_moe,
)
from llmctl.models.layers.moe import expert_act_mul
from llmctl.models.layers.scratch import Scratch
from llmctl.models.spec import ModelArch
from llmctl.serve.kernels.cpu import norm_act_kernels, rope_kv_kernel
from llmctl.serve.layers.attention import AttnMetadata, paged_attention
from llmctl.serve.layers.decode_layers import DecodeLayers
from llmctl.serve.layers.kv_quant import CODECS
from llmctl.serve.layers.rope import apply_rope, check_rope, rope_freqs

if TYPE_CHECKING:
    from llmctl.serve.lora.batch import LoRABatch

@dataclass(frozen=True)
class ModelSpec:
    """What the engine needs from an HF ``config.json`` (and generation_config.json)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: dict = field(hash=False)
    eos_token_ids: tuple[int, ...] = ()
    quantization_config: dict | None = field(default=None, hash=False)
    torch_dtype: str | None = None
    # per layer: the sliding window W (the query at p sees keys p - W + 1 .. p) or None
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"
    # the family's layer form (llmctl.models.spec.Family / ModelArch): norm layout, q/k
    # norm extent, RoPE of the sliding layers, scales and soft-caps
    norms: str = "pre"
    qk_norm_over: str = "head"
    norm_offset: float = 0.0
    partial_rotary_factor: float = 1.0
    local_rope: dict | None = field(default=None, hash=False)
    attention_scale: float = 0.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # a mixture of experts (ModelArch's fields): per layer whether it is sparse (() for a
    # dense model), E experts of width expert_intermediate_size, k per token
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()
    # gpt-oss (ModelArch's fields): a learned logit per query head in every softmax's
    # denominator (attention sinks: llmctl.serve.layers.attention), and the experts'
    # clamped SwiGLU with its constants
    attn_sinks: bool = False
    expert_act: str | None = None
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0

    @property
    def kv_window(self) -> int | None:
        """Keys further back than this from every future query are never read again: the
        largest window when every layer has one; None (keep everything) when any layer
        attends fully."""
        windows = self.layer_windows
        if not windows or any(w is None for w in windows):
            return None
        return max(windows)

    @property
    def window_free_len(self) -> int | None:
        """The longest context on which every window is no restriction (the smallest
        window), None without windows: a runtime computing full attention is exact up
        to here."""
        return min((w for w in self.layer_windows if w is not None), default=None)

    @classmethod
    def from_dir(cls, path: Path) -> ModelSpec:
        config = json.loads((Path(path) / "config.json").read_text())
        return cls.from_config(config, _generation_eos(Path(path)))

    @classmethod
    def from_config(cls, config: dict, eos: tuple[int, ...] | None = None) -> ModelSpec:
        get_architecture(config.get("model_type", ""))  # raises with the supported list
        arch = ModelArch.from_config(config)
        check_rope(arch)
        activation(arch.hidden_act)  # raises with the activations the engine computes
        if eos is None:
            eos = _as_tuple(config.get("eos_token_id"))
        # the fields named as in ModelArch are its own; the rest are the engine's
        same = {f.name: getattr(arch, f.name) for f in fields(cls) if hasattr(arch, f.name)}
        return cls(**same | {
            "max_position_embeddings": arch.max_position_embeddings or 2048,
            "norms": arch.family.norms, "qk_norm_over": arch.family.qk_norm_over,
            "norm_offset": arch.family.norm_offset,
            # the dense MLP's width; 0 where every layer is a mixture of experts, so that
            # a LoRA on gate/up/down (which those layers do not have) does not fit
            "intermediate_size": 0 if arch.moe_layers and all(arch.moe_layers)
            else arch.intermediate_size,
            "eos_token_ids": eos,
            "quantization_config": config.get("quantization_config"),
            "torch_dtype": config.get("torch_dtype") or config.get("dtype")})


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _generation_eos(path: Path) -> tuple[int, ...] | None:
    """HF ``generate`` stops on generation_config's EOS ids: so does the engine."""
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            return _as_tuple(eos)
    return None


class Layer:
    # qkv's q and k rows are in interleaved-pair order (rope.interleave_rows). qk_norm:
    # per head (qwen3, gemma3) q_norm/k_norm as one [heads + kv_heads, head_dim] table,
    # over the projection (olmo2) one [(heads + kv_heads) * head_dim] vector, in the same
    # order. The norms by slot (spec.NORM_LAYOUTS; None where the family has none):
    # input_norm before attention, attn_out_norm on its output, post_norm before the MLP
    # (Llama's post_attention_layernorm), mlp_out_norm on the MLP's output. Gemma's
    # (1 + w) is folded into the weights at load. moe: a mixture-of-experts layer's
    # router and experts (llmctl.models.layers.moe.MoeWeights), in place of gate_up/down.
    # sinks: the attention sinks' logits [heads] (gpt-oss), float32.
    __slots__ = ("attn_out_norm", "down", "gate_up", "input_norm", "mlp_out_norm", "moe",
                 "o", "post_norm", "qk_norm", "qkv", "sinks")

    def __init__(self, **parts) -> None:
        for name in self.__slots__:
            setattr(self, name, parts.get(name))


# the activations the engine's MLP computes: its kernels and fused decode layers are SwiGLU
SWIGLU = ("silu", "swish")


class TorchNormAct:
    """Residual add + RMSNorm, and the gated MLP's activation, as the shared torch blocks
    (any dtype/device); :class:`llmctl.serve.kernels.cpu.NormActKernels` fuses them for
    bf16 on the CPU. The functions themselves, not wrappers: no extra call per op."""

    add_rms_norm = staticmethod(add_rms_norm)
    silu_mul = staticmethod(fused_gated("silu"))

    @staticmethod
    def act_mul(name: str):
        return fused_gated(name)

    @staticmethod
    def qk_norm(qk: torch.Tensor, weight: torch.Tensor, q_size: int, head_dim: int,
                per_head: bool, eps: float) -> torch.Tensor:
        """q and k of ``qk [T, q + kv]`` RMS-normed per head (``weight [heads, d]``) or
        over each whole projection (``weight [q + kv]``), as
        :meth:`llmctl.serve.kernels.cpu.NormActKernels.qk_norm` computes it."""
        t = qk.shape[0]
        if per_head:
            return (fused_rms_norm(qk.reshape(t, -1, head_dim), None, eps) * weight).view(t, -1)
        q = fused_rms_norm(qk[:, :q_size], None, eps) * weight[:q_size]
        k = fused_rms_norm(qk[:, q_size:], None, eps) * weight[q_size:]
        return torch.cat([q, k], dim=-1)


def _act_mul(ops, name: str):
    """The native ``act(gate) * up`` where the kernels have ``name``, else torch's."""
    return ops.act_mul(name) or fused_gated(name)


def _add_norm(ops, x: torch.Tensor, branch: torch.Tensor | None, weight: torch.Tensor | None,
              eps: float) -> torch.Tensor:
    """``x += branch``, then the next norm of x; without a norm (OLMo 2 feeds the residual
    stream itself into attention and MLP) x itself."""
    if weight is not None:
        return ops.add_rms_norm(x, branch, weight, eps)
    if branch is not None:
        x.add_(branch)
    return x


class LlamaModel:
    """Weights + forward. Build with :func:`llmctl.serve.model.weights.load_model`."""

    def __init__(self, spec: ModelSpec, *, embed: torch.Tensor, layers: list[Layer],
                 norm: torch.Tensor, lm_head, dtype: torch.dtype, device: torch.device,
                 max_len: int) -> None:
        self.spec = spec
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.dtype = dtype
        self.device = device
        def table(params: dict) -> torch.Tensor:
            return rope_freqs(params, spec.head_dim, spec.max_position_embeddings, max_len,
                              partial=spec.partial_rotary_factor).to(device)

        self.freqs = table(spec.rope)
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.attention_scale or spec.head_dim ** -0.5
        self.norm_act = norm_act_kernels(device, dtype) or TorchNormAct()
        self.act_mul = _act_mul(self.norm_act, spec.hidden_act)
        # the experts' act(gate) * up: torch's on any rows (the native kernels serve the
        # dense layers); gpt-oss's clamped SwiGLU on interleaved gate/up columns
        self.moe_act_mul = expert_act_mul(spec)
        self.moe_scratch = Scratch()  # the experts' [tokens x k, hidden] buffers, reused
        self.rope_kv = rope_kv_kernel(device, dtype, self.freqs)
        # per layer: its RoPE table and native RoPE + cache write (Gemma 3's sliding
        # layers rotate with their own), its window
        windows = spec.layer_windows or (None,) * len(layers)
        local = table(spec.local_rope) if spec.local_rope is not None else None
        local_kv = rope_kv_kernel(device, dtype, local) if local is not None else None
        self.layer_rope = [(local, local_kv) if w and local is not None
                           else (self.freqs, self.rope_kv) for w in windows]
        self.windows = windows
        # Gemma rounds sqrt(hidden) to the model's dtype first (its transformers code)
        self.embed_scale = (None if spec.embedding_multiplier == 1.0 else
                            torch.tensor(spec.embedding_multiplier, dtype=dtype, device=device))
        # None where it cannot reproduce us. Attention sinks: the fused layer's attention
        # call passes none (csrc/decode_layer.cpp). Giving it them would buy nothing today:
        # gpt-oss, the one family with sinks, has mixture-of-experts layers, which the fused
        # layer has no form for (DecodeLayers.supports refuses them too)
        self.decode_layers = None if spec.attn_sinks else DecodeLayers.build(self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                kv_cache: torch.Tensor, kv_scales: torch.Tensor | None = None,
                lora: LoRABatch | None = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm; writes K/V into the cache
        (``kv_scales``: the scales of an int8 or fp8 cache, :mod:`llmctl.serve.layers.kv_quant`).

        ``lora``: the step's rows that run with an adapter (:mod:`llmctl.serve.lora.batch`);
        the fused native decode layers take such a step when its adapters' sums run
        natively (``lora.native``: the LoRA kernel is built), the layer loop otherwise."""
        spec = self.spec
        eps = spec.rms_norm_eps
        t = input_ids.shape[0]
        nh, nkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        quantized = kv_scales is not None
        codec = CODECS[kv_cache.dtype] if quantized else None
        native_rope = kv_cache.dtype == torch.bfloat16 or quantized
        # Fresh prompts attend over their K/V as the cache holds them (quantized, then
        # dequantized), not over the full-precision values just computed: so a prefill's
        # logits (what `llmctl eval` scores) carry the same quantization error as every
        # later decode step reading those tokens back, and teacher-forced evaluation
        # measures what generation experiences.
        reread = quantized and any(g.fresh for g in meta.groups)
        slots = meta.slot_mapping
        ops = self.norm_act
        # x is the residual stream, updated in place; each norm also adds the residual
        # branch that precedes it (the last layer's MLP output goes into the final norm)
        x = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        h = _add_norm(ops, x, None, self.layers[0].input_norm, eps)
        fused = self.decode_layers
        if fused is not None and (lora is None or lora.native is not None) \
                and fused.applies(t, meta, kv_cache):
            return fused(x, h, positions, meta, kv_cache, kv_scales, lora)
        freqs_at = {}  # RoPE table -> its rows at this step's positions
        for i, layer in enumerate(self.layers):
            qkv = self._linear(lora, i, "qkv", h)
            qk = self._qk_norm(layer, qkv, t).view(t, nh + nkv, d)
            v = qkv[:, self.q_size + self.kv_size:].view(t, nkv, d)
            layer_cache = kv_cache[i]
            layer_scales = kv_scales[i] if quantized else None
            table, rope_kv = self.layer_rope[i]
            if native_rope and rope_kv is not None:  # bf16: rotate in place, write the cache
                rope_kv(qk, v, positions, slots, layer_cache, layer_scales)
                q, k = qk[:, :nh], qk[:, nh:]
            else:
                if id(table) not in freqs_at:
                    freqs_at[id(table)] = table[positions].unsqueeze(1)
                qk = apply_rope(qk, freqs_at[id(table)])  # q and k rotated together
                q, k = qk[:, :nh], qk[:, nh:]
                if quantized:
                    codec.write(layer_cache, layer_scales, slots, k, v)
                else:
                    cache_dtype = layer_cache.dtype
                    if cache_dtype != q.dtype:
                        q, k, v = q.to(cache_dtype), k.to(cache_dtype), v.to(cache_dtype)
                    layer_cache[0].view(-1, nkv, d).index_copy_(0, slots, k)
                    layer_cache[1].view(-1, nkv, d).index_copy_(0, slots, v)
            if reread:
                k, v = codec.read(layer_cache, layer_scales, slots, q.dtype)
            attn = paged_attention(q, k, v, layer_cache, meta, self.scale, self.windows[i],
                                   layer_scales, softcap=spec.attn_softcap, sinks=layer.sinks)
            o = self._branch(layer.attn_out_norm, self._linear(lora, i, "o", attn.to(x.dtype)))
            h = _add_norm(ops, x, o, layer.post_norm, eps)
            if layer.moe is not None:
                mlp = self._moe(layer, lora, i, h)
            else:
                mlp = self._linear(lora, i, "down",
                                   self.act_mul(self._linear(lora, i, "gate_up", h)))
            following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            h = _add_norm(ops, x, self._branch(layer.mlp_out_norm, mlp), following, eps)
        return h

    def _qk_norm(self, layer: Layer, qkv: torch.Tensor, t: int) -> torch.Tensor:
        """q and k of ``qkv`` (``[t, q + kv]``), RMS-normed per head or over each whole
        projection where the family norms them."""
        qk = qkv[:, :self.q_size + self.kv_size]
        if layer.qk_norm is None:
            return qk
        spec = self.spec
        return self.norm_act.qk_norm(qk, layer.qk_norm, self.q_size, spec.head_dim,
                                     spec.qk_norm_over == "head", spec.rms_norm_eps)

    def _branch(self, out_norm: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
        """A branch's output as the residual add takes it: normed after (Gemma 2/3,
        OLMo 2), times the residual multiplier (Granite)."""
        if out_norm is not None:
            y = self.norm_act.add_rms_norm(y, None, out_norm, self.spec.rms_norm_eps)
        rs = self.spec.residual_multiplier
        return y if rs == 1.0 else y * rs

    def _linear(self, lora: LoRABatch | None, i: int, target: str,
                x: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s fused linear ``target`` on ``x``, plus the step's LoRA terms."""
        y = getattr(self.layers[i], target)(x)
        if lora is not None:
            lora.apply(i, target, x, y)
        return y

    def _moe(self, layer: Layer, lora: LoRABatch | None, i: int, h: torch.Tensor
             ) -> torch.Tensor:
        """Layer ``i``'s mixture of experts on ``h``. An adapter with terms on this layer's
        MLP cannot be applied (the loader refuses expert modules; gate/up/down of a dense
        layer's width could still name a sparse layer): refused, not skipped."""
        if lora is not None and any(
                adapter.layers[i].get(t) is not None
                for adapter, _ in lora.segments for t in ("gate_up", "down")):
            from llmctl.serve.lora.adapter import LoRAError

            raise LoRAError(f"a LoRA adapter adapts the MLP of layer {i}, a mixture of "
                            "experts", "LoRA on experts is not supported: adapt attention")
        return sparse_moe(h, layer.moe, self.moe_act_mul, self.moe_scratch)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head's logits in float32: divided by Granite's ``logits_scaling``,
        soft-capped as Gemma 2 caps them (``cap * tanh(logits / cap)``)."""
        logits = self.lm_head(hidden).float()
        if self.spec.logits_scaling != 1.0:
            logits = logits / self.spec.logits_scaling
        cap = self.spec.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    @property
    def bytes_read_per_step(self) -> int:
        """Weight bytes a batch-1 decode step reads (what MBU counts): everything held,
        except the embedding table when the head multiplies a copy of it (packed, int8)
        or its own weight (the lookup reads only a step's rows), and except the experts a
        token does not pick: a mixture-of-experts layer reads its router, shared expert
        and ``k`` of its ``E`` experts, ``(E - k) / E`` of the experts' bytes fewer
        (:attr:`MoeWeights.active_nbytes`). A batch of ``B`` tokens reads up to
        ``min(E, B k)`` experts; this counts one token's."""
        total = self.nbytes
        if getattr(self.lm_head, "weight", None) is not self.embed:
            total -= self.embed.numel() * self.embed.element_size()
        for layer in self.layers:
            if layer.moe is not None:
                total -= layer.moe.nbytes - layer.moe.active_nbytes
        return total

    @property
    def nbytes(self) -> int:
        total = self.embed.numel() * self.embed.element_size()
        total += self.norm.numel() * self.norm.element_size()
        if self.lm_head is not None and getattr(self.lm_head, "weight", None) is not self.embed:
            total += self.lm_head.nbytes
        for layer in self.layers:
            for name in Layer.__slots__:
                part = getattr(layer, name)
                if isinstance(part, torch.Tensor):
                    total += part.numel() * part.element_size()
                elif part is not None:
                    total += part.nbytes
        return total
