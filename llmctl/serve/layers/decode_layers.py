"""Decode steps as one native call per decoder layer: up to MAX_ROWS tokens on bf16
weights in the own-kernel form (1-4 where bf16 layers keep it for small batches only)
or on int4/int8 codes in the AVX2 layout, up to 8 on int4/int8 codes in the VNNI layout
(that kernel's rows), up to 12 on bf16 weights widened by the AVX2 kernel (where
:class:`WideningBF16Linear` stops calling it).

:file:`csrc/decode_layer.cpp` runs a layer's ten kernels (the small-batch matrix products,
RoPE + cache write, paged attention, the fused norms and SwiGLU or GeGLU) from C, on the
same data in the same order as :meth:`llmctl.serve.model.decoder.LlamaModel.forward` does from
Python, so the hidden states are bit for bit the same; what goes is ~10 Python-to-C
transitions and tensor allocations per layer (about 1 ms of a SmolLM2 batch-1 token, and
3-4 ms of a 64-row step: development A/B in one process, 6 rounds alternating, step
median 62.5 vs 65.9 ms, same tokens).

The matrix forms (:func:`matrix`, the C file's ``Matrix.kind``): AVX512-BF16 / VNNI CPUs
run a :class:`PackedLinear`'s own-kernel weight (0) and a :class:`LowBitLinear`'s VNNI
codes (1); AVX2-only CPUs (AMD Zen 3: no AVX-512, no native bf16) a
:class:`WideningBF16Linear`'s torch-layout bf16 weight (2) and a :class:`LowBitLinear`'s
AVX2 codes (3), each called with the arguments its Python layer passes. A layer may mix
forms. A bias (bf16) is added as the Python layer adds it.

The layer forms of :meth:`llmctl.serve.model.decoder.LlamaModel.forward`, as its layer loop
computes them: per layer a sliding window, a RoPE table (Gemma 3's sliding layers rotate
with their own; a table narrower than the head rotates part of it), the norms it has (an
input norm or none: OLMo 2 reads the residual stream; norms on attention's and the MLP's
outputs: Gemma 2/3, OLMo 2; a pre-MLP norm or none); per model the attention scale and
logit soft-cap, the activation (SwiGLU or GeGLU) and the residual multiplier (Granite).

LoRA: a step with adapter rows runs here too when its segments are native
(:class:`LoRABatch.native`); each fused linear adds its adapters' terms with
:file:`csrc/lora.cpp`, the kernel the layer loop calls, so the bits stay the layer loop's.

It applies when every matrix of every layer has one of those forms, q/k norms as the
layer loop computes them on native ops (:meth:`NormActKernels.qk_norm`; torch's RMSNorm
op sums in an order the C side does not reproduce), every layer's RoPE
on the native kernel, the fused norm and activation kernels, bfloat16 activations, a
bfloat16, int8 or fp8 cache, and the step is one attention group of single-token
sequences on the native kernel; :meth:`DecodeLayers.build` returns None otherwise (the
layer loop runs). A mixture-of-experts layer (router, experts) has no C form: such a
model runs the layer loop.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from llmctl.serve.kernels.cpu import NormActKernels, decode_layer_kernel
from llmctl.serve.layers.attention import AttnMetadata
from llmctl.serve.layers.lowbit import LowBitLinear
from llmctl.serve.layers.quant_linear import PackedLinear, WideningBF16Linear

if TYPE_CHECKING:
    from llmctl.serve.lora.batch import LoRABatch

_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
# The most tokens a step runs here on bf16 weights: the scratch buffers are sized for it
# (4 MB for SmolLM2, ~30 MB for an 8B Llama); larger steps take the Python path, where
# ten calls per layer are a small share of the step.
MAX_ROWS = 256
# the caches it runs on (csrc/decode_layer.cpp's kv_kind): bf16, int8 codes with scales
# per slot, E4M3 codes (uint8) with static scales
_KV_KINDS = {torch.bfloat16: 0, torch.int8: 1, torch.uint8: 2}


class Matrix(ctypes.Structure):
    """:file:`csrc/decode_layer.cpp`'s ``Matrix``."""

    _fields_ = [("kind", _I64), ("w", _PTR), ("s", _PTR), ("z", _PTR), ("bits", _I64),
                ("blocks", _I64), ("k", _I64), ("group", _I64), ("n", _I64), ("bias", _PTR)]


class Step(ctypes.Structure):
    """:file:`csrc/decode_layer.cpp`'s ``Step``."""

    _fields_ = [("m", _I64), ("hidden", _I64), ("q_heads", _I64), ("kv_heads", _I64),
                ("head_dim", _I64), ("positions", _PTR), ("slots", _PTR),
                ("block_tables", _PTR), ("max_blocks", _I64), ("context_lens", _PTR),
                ("block_size", _I64), ("scale", _F32), ("eps", _F32), ("x", _PTR), ("h", _PTR),
                ("qkv", _PTR), ("attn", _PTR), ("attn_f", _PTR), ("proj", _PTR),
                ("gate_up", _PTR), ("act_out", _PTR), ("num_threads", _INT),
                ("lora", _PTR), ("lora_n", _I64), ("layer", _I64), ("sums", _PTR),
                ("softcap", _F32), ("act", _I64), ("residual_scale", _F32)]


class LayerArgs(ctypes.Structure):
    """:file:`csrc/decode_layer.cpp`'s ``Layer``: one layer's matrices, RoPE table,
    window and norms (null: the layer has none)."""

    _fields_ = [("qkv", _PTR), ("o", _PTR), ("gate_up", _PTR), ("down", _PTR),
                ("freqs", _PTR), ("rot", _I64), ("window", _I64), ("input_is_x", _I64),
                ("attn_out_norm", _PTR), ("post_norm", _PTR), ("mlp_out_norm", _PTR),
                ("next_norm", _PTR), ("qk_norm", _PTR), ("qk_norm_per_head", _I64)]


# the gated MLP's activation by HF name -> decode_layer.cpp's Step.act
ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1}


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def matrix(layer) -> tuple[Matrix, int] | None:
    """The small-batch form of a layer and the most rows it takes (where its Python
    layer calls the same kernel), or None when it has none."""
    bias = getattr(layer, "bias", None)
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        return None
    b = None if bias is None else bias.data_ptr()
    if isinstance(layer, PackedLinear) and layer.own is not None:
        g = layer.own
        return Matrix(0, g.packed.data_ptr(), None, None, 16, g.blocks, g.in_features, 0,
                      g.out_features, b), min(layer.own_rows, MAX_ROWS)
    if isinstance(layer, WideningBF16Linear):
        n, k = layer.weight.shape
        return Matrix(2, layer.weight.data_ptr(), None, None, 16, 0, k, 0, n, b), \
            min(WideningBF16Linear.KERNEL_MAX_ROWS, MAX_ROWS)
    if not isinstance(layer, LowBitLinear) or layer.out_float or layer.codebook is not None:
        return None  # decode_layer.cpp has no E2M1 table (MXFP4 experts: MoE has no C form)
    if layer.vnni_rows:
        packed, scales, zeros = layer.vnni_codes
        return Matrix(1, packed.data_ptr(), scales.data_ptr(),
                      None if zeros is None else zeros.data_ptr(), layer.bits, scales.shape[0],
                      layer.in_features, layer.group_size, layer.out_features, b), \
            layer.vnni_rows
    if layer.avx2:  # every row count above vnni_rows runs there (LowBitLinear.__call__)
        return Matrix(3, layer.packed.data_ptr(), layer.scales.data_ptr(),
                      None if layer.zeros is None else layer.zeros.data_ptr(), layer.bits,
                      layer.scales.shape[0], layer.in_features, layer.group_size,
                      layer.out_features, b), MAX_ROWS
    return None


class DecodeLayers:
    """Per-layer descriptors and scratch buffers for one model (see the module doc)."""

    def __init__(self, model, fn, matrices: list[tuple[Matrix, ...]], max_rows: int) -> None:
        spec = model.spec
        self.max_rows = max_rows  # the fewest any matrix takes, at most MAX_ROWS
        self._fn = fn
        self._matrices = matrices  # kept alive: the C side holds pointers into them
        # the per-layer arguments that never change, bound once (this is the decode loop)
        self._layers = [LayerArgs(*(ctypes.addressof(m) for m in mats),
                                  **self._layer_fields(model, i))
                        for i, mats in enumerate(matrices)]
        self._layer_refs = [ctypes.byref(la) for la in self._layers]
        self._windows = [la.window for la in self._layers]  # each layer's (0: none)
        rows, qkv_n, gate_up_n = max_rows, matrices[0][0].n, matrices[0][2].n
        q_size = spec.num_heads * spec.head_dim
        bf16 = torch.bfloat16
        self._scratch = {
            "qkv": torch.empty(rows * qkv_n, dtype=bf16),
            "attn": torch.empty(rows * q_size, dtype=bf16),
            "attn_f": torch.empty(rows * q_size, dtype=torch.float32),
            "proj": torch.empty(rows * spec.hidden_size, dtype=bf16),
            "gate_up": torch.empty(rows * gate_up_n, dtype=bf16),
            "act_out": torch.empty(rows * gate_up_n // 2, dtype=bf16),
            # a widened bf16 product's float32 sums, before its bias (kind 2 only)
            "sums": torch.empty(rows * max((m.n for mats in matrices for m in mats
                                            if m.kind == 2 and m.bias), default=0),
                                dtype=torch.float32),
        }
        self._step = Step(hidden=spec.hidden_size, q_heads=spec.num_heads,
                          kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                          scale=model.scale, eps=spec.rms_norm_eps,
                          softcap=spec.attn_softcap or 0.0, act=ACTIVATIONS[spec.hidden_act],
                          residual_scale=spec.residual_multiplier,
                          **{k: v.data_ptr() for k, v in self._scratch.items()})

    @staticmethod
    def _layer_fields(model, i: int) -> dict:
        """Layer ``i``'s table, window and norms, as the layer loop reads them."""
        layer, layers = model.layers[i], model.layers
        following = layers[i + 1].input_norm if i + 1 < len(layers) else model.norm
        rope_kv = model.layer_rope[i][1]
        return {"freqs": rope_kv.freqs.data_ptr(), "rot": rope_kv.rot,
                "window": model.windows[i] or 0, "input_is_x": layer.input_norm is None,
                "attn_out_norm": _ptr(layer.attn_out_norm), "post_norm": _ptr(layer.post_norm),
                "mlp_out_norm": _ptr(layer.mlp_out_norm), "next_norm": _ptr(following),
                "qk_norm": _ptr(layer.qk_norm),
                "qk_norm_per_head": model.spec.qk_norm_over == "head"}

    @staticmethod
    def supports(model) -> bool:
        """Whether every layer computes what the C layer does (the module doc's list)."""
        spec = model.spec
        if not isinstance(model.norm_act, NormActKernels) or model.norm is None:
            return False
        if spec.hidden_act not in ACTIVATIONS:
            return False
        # the C layer computes one dense MLP per layer: a mixture of experts runs the loop
        if any(getattr(layer, "moe", None) is not None for layer in model.layers):
            return False
        if any(rope_kv is None for _, rope_kv in model.layer_rope):
            return False
        # with the native elementwise ops the layer loop norms q/k on NormActKernels.qk_norm
        # too: the kernel this layer calls
        return spec.qk_norm_over in ("head", "projection")

    @classmethod
    def build(cls, model) -> DecodeLayers | None:
        fn = decode_layer_kernel()
        if fn is None or model.dtype != torch.bfloat16 or not cls.supports(model):
            return None
        matrices, max_rows = [], None
        for layer in model.layers:
            forms = [matrix(getattr(layer, n)) for n in ("qkv", "o", "gate_up", "down")]
            if any(f is None for f in forms):
                return None
            matrices.append(tuple(f[0] for f in forms))
            max_rows = min([f[1] for f in forms] + ([max_rows] if max_rows else []))
        return cls(model, fn, matrices, max_rows) if matrices else None

    def applies(self, tokens: int, meta: AttnMetadata, kv_cache: torch.Tensor) -> bool:
        """A step of up to ``max_rows`` single-token sequences, one kernel group, a bf16
        or 8-bit cache."""
        if not 0 < tokens <= self.max_rows or len(meta.groups) != 1:
            return False
        grp = meta.groups[0]
        return (grp.q_len == 1 and grp.context_lens is not None
                and kv_cache.dtype in _KV_KINDS and kv_cache.is_contiguous())

    def __call__(self, x: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
                 meta: AttnMetadata, kv_cache: torch.Tensor,
                 kv_scales: torch.Tensor | None = None,
                 lora: LoRABatch | None = None) -> torch.Tensor:
        """Every layer on ``x`` (residual, updated) and ``h`` (the first layer's normed
        input; ``x`` itself where the first layer has no input norm); returns the final
        norm's output, as ``forward`` does. ``lora``: the step's adapter rows, with
        ``native`` segments (the caller checks)."""
        if h.data_ptr() == x.data_ptr():  # no input norm: h is x, the norms need their own
            h = torch.empty_like(x)
        grp = meta.groups[0]
        st = self._step
        st.m = x.shape[0]
        segs = lora.native if lora is not None else None
        st.lora = ctypes.addressof(segs) if segs is not None else None
        st.lora_n = len(segs) if segs is not None else 0
        st.positions, st.slots = positions.data_ptr(), meta.slot_mapping.data_ptr()
        st.block_tables, st.max_blocks = grp.block_tables.data_ptr(), grp.block_tables.shape[1]
        st.context_lens, st.block_size = grp.context_lens.data_ptr(), kv_cache.shape[3]
        st.x, st.h, st.num_threads = x.data_ptr(), h.data_ptr(), torch.get_num_threads()
        ref, fn = ctypes.byref(st), self._fn
        # kv_cache [layers, 2, ...] contiguous: layer i's K and V at fixed byte offsets
        half = kv_cache.stride(1) * kv_cache.element_size()
        k_ptr = kv_cache.data_ptr()
        # an 8-bit cache's scales [layers, 2, ...] likewise (null pointers: a bf16 cache)
        s_half = kv_scales.stride(1) * 4 if kv_scales is not None else 0
        s_ptr = kv_scales.data_ptr() if kv_scales is not None else None
        kind = _KV_KINDS[kv_cache.dtype]
        for layer, args in enumerate(self._layer_refs):
            st.layer = layer
            fn(ref, args, k_ptr, k_ptr + half, s_ptr, s_ptr + s_half if s_ptr else None, kind)
            k_ptr += 2 * half
            if s_ptr:
                s_ptr += 2 * s_half
        return h
