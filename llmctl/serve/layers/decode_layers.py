"""Decode steps as one native call per decoder layer: up to MAX_ROWS tokens on bf16
weights in the own-kernel form (1-4 where bf16 layers keep it for small batches only)
or on int4/int8 codes in the AVX2 layout, up to 8 on int4/int8 codes in the VNNI layout
(that kernel's rows), up to 12 on bf16 weights widened by the AVX2 kernel (where
:class:`WideningBF16Linear` stops calling it).

:file:`csrc/decode_layer.cpp` runs a layer's ten kernels (the small-batch matrix products,
RoPE + cache write, paged attention, the fused norms and SwiGLU) from C, on the same
data in the same order as :meth:`llmctl.serve.model.decoder.LlamaModel.forward` does from
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

Sliding windows: each layer's window goes to its attention call (``Step.window``).

LoRA: a step with adapter rows runs here too when its segments are native
(:class:`LoRABatch.native`); each fused linear adds its adapters' terms with
:file:`csrc/lora.cpp`, the kernel the layer loop calls, so the bits stay the layer loop's.

It applies when every matrix of every layer has one of those forms, no q/k norm,
bfloat16 activations, a bfloat16, int8 or fp8 cache, and the step is one attention group
of single-token sequences on the native kernel; :meth:`DecodeLayers.build` returns None
otherwise.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from llmctl.serve.kernels.cpu import decode_layer_kernel
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
                ("head_dim", _I64), ("freqs", _PTR), ("positions", _PTR), ("slots", _PTR),
                ("block_tables", _PTR), ("max_blocks", _I64), ("context_lens", _PTR),
                ("block_size", _I64), ("scale", _F32), ("eps", _F32), ("x", _PTR), ("h", _PTR),
                ("qkv", _PTR), ("attn", _PTR), ("attn_f", _PTR), ("proj", _PTR),
                ("gate_up", _PTR), ("act", _PTR), ("num_threads", _INT), ("window", _I64),
                ("lora", _PTR), ("lora_n", _I64), ("layer", _I64), ("sums", _PTR),
                ("softcap", _F32), ("rot", _I64)]


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
    if not isinstance(layer, LowBitLinear) or layer.out_float:
        return None
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
        following = [layer.input_norm for layer in model.layers[1:]] + [model.norm]
        # each layer's sliding window (0: none), set in the Step before its call
        windows = spec.layer_windows or (None,) * len(model.layers)
        self._windows = [w or 0 for w in windows]
        # the per-layer arguments that never change, bound once (this is the decode loop)
        self._layer_args = [
            (*(ctypes.byref(m) for m in mats), layer.post_norm.data_ptr(), nxt.data_ptr())
            for mats, layer, nxt in zip(matrices, model.layers, following)]
        rows, qkv_n, gate_up_n = max_rows, matrices[0][0].n, matrices[0][2].n
        q_size = spec.num_heads * spec.head_dim
        bf16 = torch.bfloat16
        self._scratch = {
            "qkv": torch.empty(rows * qkv_n, dtype=bf16),
            "attn": torch.empty(rows * q_size, dtype=bf16),
            "attn_f": torch.empty(rows * q_size, dtype=torch.float32),
            "proj": torch.empty(rows * spec.hidden_size, dtype=bf16),
            "gate_up": torch.empty(rows * gate_up_n, dtype=bf16),
            "act": torch.empty(rows * gate_up_n // 2, dtype=bf16),
            # a widened bf16 product's float32 sums, before its bias (kind 2 only)
            "sums": torch.empty(rows * max((m.n for mats in matrices for m in mats
                                            if m.kind == 2 and m.bias), default=0),
                                dtype=torch.float32),
        }
        self._step = Step(hidden=spec.hidden_size, q_heads=spec.num_heads,
                          kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                          freqs=model.rope_kv.freqs.data_ptr(), rot=model.rope_kv.rot,
                          scale=model.scale,
                          eps=spec.rms_norm_eps,
                          **{k: v.data_ptr() for k, v in self._scratch.items()})

    @classmethod
    def build(cls, model) -> DecodeLayers | None:
        fn = decode_layer_kernel()
        if fn is None or model.rope_kv is None or model.dtype != torch.bfloat16:
            return None
        matrices, max_rows = [], None
        for layer in model.layers:
            if layer.qk_norm is not None:
                return None
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
        input); returns the final norm's output, as ``forward`` does. ``lora``: the step's
        adapter rows, with ``native`` segments (the caller checks)."""
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
        for layer, ((qkv, o, gate_up, down, post, nxt), window) in enumerate(
                zip(self._layer_args, self._windows)):
            st.window, st.layer = window, layer
            fn(ref, qkv, o, gate_up, down, k_ptr, k_ptr + half, s_ptr,
               s_ptr + s_half if s_ptr else None, kind, post, nxt)
            k_ptr += 2 * half
            if s_ptr:
                s_ptr += 2 * s_half
        return h
