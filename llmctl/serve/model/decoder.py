"""The Llama-family forward pass, written for the paged KV cache.

One decoder covers llama, mistral, qwen2 and qwen3: they differ in data, not code
(their rows of :data:`llmctl.models.spec.FAMILIES`, read into
:class:`llmctl.models.spec.ModelArch`): qkv biases (qwen2 always, llama/qwen3 when
``attention_bias``), an RMSNorm over each head of q and k before RoPE (qwen3), tied embeddings, and which
layers attend through a sliding window (``spec.WINDOW_RULES``, as transformers reads the
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

from llmctl.errors import UnsupportedArchitectureError
from llmctl.models.architectures import get_architecture
from llmctl.models.layers import add_rms_norm, fused_gated, fused_rms_norm
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
        if arch.hidden_act not in SWIGLU:
            raise UnsupportedArchitectureError(
                f"MLP activation {arch.hidden_act!r}: the engine's MLP is SwiGLU",
                "use a model whose config.json sets hidden_act to silu")
        if eos is None:
            eos = _as_tuple(config.get("eos_token_id"))
        # the fields named as in ModelArch are its own; the rest are the engine's
        same = {f.name: getattr(arch, f.name) for f in fields(cls) if hasattr(arch, f.name)}
        return cls(**same | {
            "max_position_embeddings": arch.max_position_embeddings or 2048,
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
    # qkv's q and k rows are in interleaved-pair order (rope.interleave_rows); qk_norm is
    # qwen3's q_norm/k_norm as one [heads + kv_heads, head_dim] table in the same order.
    __slots__ = ("input_norm", "qkv", "qk_norm", "o", "post_norm", "gate_up", "down")

    def __init__(self, **parts) -> None:
        for name in self.__slots__:
            setattr(self, name, parts.get(name))


# the activations the engine's MLP computes: its kernels and fused decode layers are SwiGLU
SWIGLU = ("silu", "swish")


class TorchNormAct:
    """Residual add + RMSNorm, and SwiGLU's activation, as the shared torch blocks (any
    dtype/device); :class:`llmctl.serve.kernels.cpu.NormActKernels` fuses them for bf16
    on the CPU. The functions themselves, not wrappers: no extra call per op."""

    add_rms_norm = staticmethod(add_rms_norm)
    silu_mul = staticmethod(fused_gated("silu"))


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
        self.freqs = rope_freqs(spec.rope, spec.head_dim, spec.max_position_embeddings,
                                max_len).to(device)
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim ** -0.5
        self.norm_act = norm_act_kernels(device, dtype) or TorchNormAct()
        self.rope_kv = rope_kv_kernel(device, dtype, self.freqs)
        self.decode_layers = DecodeLayers.build(self)

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
        rope_kv = self.rope_kv if kv_cache.dtype == torch.bfloat16 or quantized else None
        # Fresh prompts attend over their K/V as the cache holds them (quantized, then
        # dequantized), not over the full-precision values just computed: so a prefill's
        # logits (what `llmctl eval` scores) carry the same quantization error as every
        # later decode step reading those tokens back, and teacher-forced evaluation
        # measures what generation experiences.
        reread = quantized and any(g.fresh for g in meta.groups)
        freqs = self.freqs[positions].unsqueeze(1) if rope_kv is None else None
        qk_size = self.q_size + self.kv_size
        slots = meta.slot_mapping
        windows = spec.layer_windows or (None,) * len(self.layers)
        ops = self.norm_act
        # x is the residual stream, updated in place; each norm also adds the residual
        # branch that precedes it (the last layer's MLP output goes into the final norm)
        x = F.embedding(input_ids, self.embed)
        h = ops.add_rms_norm(x, None, self.layers[0].input_norm, eps)
        fused = self.decode_layers
        if fused is not None and (lora is None or lora.native is not None) \
                and fused.applies(t, meta, kv_cache):
            return fused(x, h, positions, meta, kv_cache, kv_scales, lora)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(h)
            if lora is not None:
                lora.apply(i, "qkv", h, qkv)
            qk = qkv[:, :qk_size].view(t, nh + nkv, d)
            v = qkv[:, qk_size:].view(t, nkv, d)
            if layer.qk_norm is not None:
                qk = fused_rms_norm(qk, None, eps) * layer.qk_norm
            layer_cache = kv_cache[i]
            layer_scales = kv_scales[i] if quantized else None
            if rope_kv is not None:  # bf16 throughout: rotate in place, write the cache
                rope_kv(qk, v, positions, slots, layer_cache, layer_scales)
                q, k = qk[:, :nh], qk[:, nh:]
            else:
                qk = apply_rope(qk, freqs)  # q and k rotated together
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
            attn = paged_attention(q, k, v, layer_cache, meta, self.scale, windows[i],
                                   layer_scales)
            if lora is None:
                h = ops.add_rms_norm(x, layer.o(attn.to(x.dtype)), layer.post_norm, eps)
                mlp = layer.down(ops.silu_mul(layer.gate_up(h)))
            else:
                h = ops.add_rms_norm(x, self._adapted(lora, i, "o", attn.to(x.dtype)),
                                     layer.post_norm, eps)
                act = ops.silu_mul(self._adapted(lora, i, "gate_up", h))
                mlp = self._adapted(lora, i, "down", act)
            following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            h = ops.add_rms_norm(x, mlp, following, eps)
        return h

    def _adapted(self, lora: LoRABatch, i: int, target: str, x: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s fused linear ``target`` on ``x``, plus the step's LoRA terms."""
        y = getattr(self.layers[i], target)(x)
        lora.apply(i, target, x, y)
        return y

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @property
    def bytes_read_per_step(self) -> int:
        """Weight bytes a forward step reads (what MBU counts): everything held, except the
        embedding table when the head multiplies a copy of it (packed, int8) or its own
        weight: the lookup reads only a step's rows."""
        total = self.nbytes
        if getattr(self.lm_head, "weight", None) is not self.embed:
            total -= self.embed.numel() * self.embed.element_size()
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
