"""int4 and int8 weights on llmctl's own CPU kernel (:file:`csrc/lowbit_gemm.cpp`).

Every low-bit source becomes :class:`AffineCodes`, ``w[n, k] = s[n, g] * q[n, k] +
z[n, g]`` per group of ``group_size`` inputs:

================================  =========  ==================  ======================
source                            q          s                   z
================================  =========  ==================  ======================
compressed-tensors int4           q + 8      scale               -scale * (8 + zp)
compressed-tensors int8           q          scale               -scale * zp (or none)
GGUF Q4_0 (blocks of 32)          u          d                   -8 d
GGUF Q4_1                         u          d                   m
GGUF Q8_0                         q          d                   none
MXFP4 (E2M1, blocks of 32)        T[e]       2^(e8m0 - 128)      none
================================  =========  ==================  ======================

MXFP4's nibbles stay 4-bit codes: ``codebook`` (:data:`llmctl.quant.mxfp4.FP4_TIMES_2`,
twice the E2M1 values) names the table ``T`` each nibble indexes, ``w = s * T[q]``, and
the kernels look the nibbles up in place, the scales held as their E8M0 bytes (0.5
bytes per weight and 1 per 32: 0.53, against the int8 codes' 1.125).

:class:`LowBitLinear` packs them once into the kernel's layout (the C file's header
has it and the int4 encoding: scales go in as ``16 s`` and ``z - 16 s``) and applies
them to bfloat16 activations at any batch size: batch-1 decode reads a quarter
(int4) or half (int8) of bf16's bytes, and a 64-row decode step widens each weight
once for 16 rows. Where the CPU has AVX512-VNNI, layers whose groups are whole blocks of
32 inputs also keep a second copy of the codes in :file:`csrc/lowbit_vnni.cpp`'s byte
layout (same size as the first) for one to eight rows: there the bfloat16 widening,
not memory, bounded the step. A CPU with AVX2 + FMA but without AVX512-BF16 runs
:file:`csrc/lowbit_avx2.cpp` at every batch size instead (its own layout, the only copy:
lowbit_gemm.cpp would have only its scalar path there), on float32 or bfloat16
activations as they come.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl.quant import mxfp4
from llmctl.serve.kernels.cpu import lowbit_avx2_kernel, lowbit_kernel, lowbit_vnni_kernel

BLOCK = 16  # output columns per kernel block
VNNI_BLOCK = 32  # inputs per activation block of the VNNI and AVX2 kernels
AVX2_BLOCK = 32  # output columns per block of the AVX2 kernel (4 vectors of 8)
_AVX2_INPUTS = (torch.float32, torch.bfloat16)  # activation dtypes the AVX2 kernel reads
FP4_FORMAT = -4  # the kernels' ``bits`` argument for E2M1 codebook codes


@dataclass
class AffineCodes:
    """Integer codes with per-group scale and offset (see the module table)."""

    q: torch.Tensor  # [N, K]: uint8 0..15 (bits=4) or int8 (bits=8)
    scale: torch.Tensor  # [N, G] float32
    zero: torch.Tensor | None  # [N, G] float32, or None (symmetric int8)
    group_size: int
    bits: int
    codebook: tuple[float, ...] | None = None  # bits=4: q indexes it (w = s * codebook[q])

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.q.shape
        values = (self.q.float() if self.codebook is None
                  else torch.tensor(self.codebook, dtype=torch.float32)[self.q.long()])
        w = values.view(n, -1, self.group_size) * self.scale.float().unsqueeze(-1)
        if self.zero is not None:
            w = w + self.zero.float().unsqueeze(-1)
        return w.view(n, k).to(dtype)

    def map_rows(self, fn) -> AffineCodes:
        """The same codes with ``fn`` (a reordering of output rows, e.g. RoPE's
        interleaving) applied to the codes, scales and offsets alike."""
        return AffineCodes(fn(self.q), fn(self.scale), None if self.zero is None else fn(self.zero),
                           self.group_size, self.bits, self.codebook)

    @staticmethod
    def cat(parts: list[AffineCodes]) -> AffineCodes | None:
        """Stack layers sharing an input (q/k/v, gate/up); None if their schemes differ."""
        first = parts[0]
        if any(p.bits != first.bits or p.group_size != first.group_size
               or p.codebook != first.codebook for p in parts):
            return None
        zeros = [p.zero for p in parts]
        if any(z is None for z in zeros) and not all(z is None for z in zeros):
            zeros = [torch.zeros_like(p.scale) if p.zero is None else p.zero for p in parts]
        return AffineCodes(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                           None if zeros[0] is None else torch.cat(zeros),
                           first.group_size, first.bits, first.codebook)


def quantize_int8(weight: torch.Tensor, group_size: int) -> AffineCodes:
    """Symmetric int8 with one scale per ``group_size`` inputs (absmax / 127): the
    ``--lm-head int8`` option, like llama.cpp's Q8_0 head with groups of 32."""
    n, k = weight.shape
    w = weight.float().view(n, -1, group_size)
    scale = w.abs().amax(-1) / 127.0
    q = torch.round(w / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1))
    return AffineCodes(q.clamp(-127, 127).to(torch.int8).view(n, k), scale, None, group_size, 8)


def _codes_fit(codes: AffineCodes) -> bool:
    """4 or 8 bits, and a codebook only the kernels' own (E2M1's, 4 bits, no offset)."""
    if codes.codebook is None:
        return codes.bits in (4, 8)
    return (codes.bits == 4 and codes.codebook == mxfp4.FP4_TIMES_2 and codes.zero is None
            and e8m0(codes.scale) is not None)


def kernel_fits(codes: AffineCodes) -> bool:
    """Whether the kernel takes this layout: 4 or 8 bits, whole groups of a multiple of 4."""
    _, k = codes.shape
    return _codes_fit(codes) and codes.group_size % 4 == 0 and k % codes.group_size == 0


def vnni_fits(codes: AffineCodes) -> bool:
    """Whether the VNNI kernel takes this layout: groups of whole 32-input blocks, no
    codebook (it has no table lookup: a mixture's experts, the one user, keep one copy)."""
    return codes.codebook is None and avx2_fits(codes)


def avx2_fits(codes: AffineCodes) -> bool:
    """Whether the AVX2 kernel takes this layout: groups of whole 32-input blocks (it
    quantizes activations in 32-input blocks)."""
    _, k = codes.shape
    return (_codes_fit(codes) and codes.group_size % VNNI_BLOCK == 0
            and k % codes.group_size == 0)


def simd_available() -> bool:
    """The kernel's AVX512-BF16 path is built for this CPU (else keep torch's kernels)."""
    kernel = lowbit_kernel()
    return kernel is not None and kernel[1]


def avx2_available() -> bool:
    """:file:`csrc/lowbit_avx2.cpp` is built for this CPU (AVX2 + FMA): the fast path
    where :func:`simd_available` is False."""
    return lowbit_avx2_kernel() is not None


def fast_fits(codes: AffineCodes) -> bool:
    """Whether :class:`LowBitLinear` runs this layer on a SIMD kernel on this CPU (the
    AVX512-BF16 one, else the AVX2 one); where not, torch's kernels are faster."""
    if simd_available():
        return kernel_fits(codes)
    return avx2_available() and avx2_fits(codes)


def _pad_rows(t: torch.Tensor, multiple: int) -> tuple[torch.Tensor, int]:
    """``t`` with zero rows appended up to a multiple of ``multiple``, and how many."""
    n_pad = -t.shape[0] % multiple
    return (torch.cat([t, t.new_zeros(n_pad, t.shape[1])]) if n_pad else t), n_pad


def e8m0(scale: torch.Tensor) -> torch.Tensor | None:
    """E2M1 codes' scales ``2^(e - 128)`` -> the E8M0 bytes ``e`` the kernels hold
    (``frexp``: exact, subnormal ``2^-128`` too), or None where one is not such a power."""
    mantissa, exponent = torch.frexp(scale.float())
    e = exponent + mxfp4.E8M0_BIAS
    if not bool(((mantissa == 0.5) & (e >= 0) & (e <= 255)).all()):
        return None
    return e.to(torch.uint8)


def _blocked(t: torch.Tensor, n_pad: int, width: int = BLOCK) -> torch.Tensor:
    """``[N, G]`` per-row values -> ``[N/width, G, width]`` float32 (uint8 stays uint8),
    zero rows for padding."""
    t = t if t.dtype == torch.uint8 else t.float()
    if n_pad:
        t = torch.cat([t, t.new_zeros(n_pad, t.shape[1])])
    return t.view(-1, width, t.shape[1]).transpose(1, 2).contiguous()


def pack(codes: AffineCodes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(packed codes, scales, offsets)`` in the kernel's layout."""
    n, k = codes.shape
    q, n_pad = _pad_rows(codes.q, BLOCK)
    blocks = (n + n_pad) // BLOCK
    if codes.codebook is not None:  # the int4 layout, the scales as E8M0 bytes, no offset
        u = q.to(torch.uint8).view(blocks, BLOCK, k // 4, 2, 2).permute(0, 2, 3, 1, 4)
        return ((u[:, :, 0] | (u[:, :, 1] << 4)).contiguous(),
                _blocked(e8m0(codes.scale), n_pad), None)
    if codes.bits == 4:
        # byte 2c+p of step t = q[c, 4t+p] | q[c, 4t+2+p] << 4
        u = q.to(torch.uint8).view(blocks, BLOCK, k // 4, 2, 2).permute(0, 2, 3, 1, 4)
        packed = (u[:, :, 0] | (u[:, :, 1] << 4)).contiguous()
        zero = codes.zero if codes.zero is not None else torch.zeros_like(codes.scale)
        scale = codes.scale.float()
        return packed, _blocked(16 * scale, n_pad), _blocked(zero.float() - 16 * scale, n_pad)
    # int8: byte 2c+p of step t = q[c, 2t+p]
    packed = q.to(torch.int8).view(blocks, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    zero = None if codes.zero is None else _blocked(codes.zero, n_pad)
    return packed, _blocked(codes.scale, n_pad), zero


def interleave_block_pairs(t: torch.Tensor, per_step: int) -> torch.Tensor:
    """``t [N, K]`` -> ``[N/32, K/per_step, 2, 16, per_step]``: output rows in blocks of
    16 (zero rows padding N to a pair of blocks), the two blocks of a pair interleaved
    step by step, ``per_step`` inputs of a row together. The streaming layout of
    :file:`csrc/lowbit_vnni.cpp` and :file:`csrc/gemm_bf16.cpp`: each pair of blocks is
    one sequential stream."""
    n, k = t.shape
    t, n_pad = _pad_rows(t, 2 * BLOCK)
    pairs = (n + n_pad) // (2 * BLOCK)
    return t.view(pairs, 2, BLOCK, k // per_step, per_step).permute(0, 3, 1, 2, 4)


def pack_vnni(codes: AffineCodes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(packed codes, scales, offsets or None)`` in :file:`csrc/lowbit_vnni.cpp`'s layout."""
    n_pad = -codes.shape[0] % (2 * BLOCK)
    if codes.bits == 4:
        # step t, block j, byte 4c+i = q[c, 8t+i] | q[c, 8t+4+i] << 4
        u = interleave_block_pairs(codes.q.to(torch.uint8), 8)
        packed = (u[..., :4] | (u[..., 4:] << 4)).contiguous()
    else:
        # step t, block j, byte 4c+i = q[c, 4t+i] + 128
        u = (codes.q.to(torch.int16) + 128).to(torch.uint8)
        packed = interleave_block_pairs(u, 4).contiguous()
    zero = None if codes.zero is None else _blocked(codes.zero, n_pad)
    return packed, _blocked(codes.scale, n_pad), zero


def pack_avx2(codes: AffineCodes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(packed codes, scales, offsets or None)`` in :file:`csrc/lowbit_avx2.cpp`'s layout:
    blocks of 32 output rows (zero rows pad N), each a stream along k of steps of 4
    sub-blocks of 8 rows; scales and offsets ``[N/32, G, 32]``."""
    n, k = codes.shape
    q, n_pad = _pad_rows(codes.q, AVX2_BLOCK)
    blocks = (n + n_pad) // AVX2_BLOCK
    if codes.codebook is not None:
        # the kernel reads j = q ^ 15 as T[q] + 12 (zero rows: j = 0 reads 0) and makes
        # the offset -12 s from the scales itself
        q = q.to(torch.uint8) ^ 15
        if n_pad:
            q[n:] = 0
    if codes.bits == 4:
        # step t, sub-block j, 16-bit word 2c+p: bits 4i..4i+3 = q[8j+c, 8t+2i+p]
        u = q.to(torch.int32).view(blocks, 4, 8, k // 8, 4, 2).permute(0, 3, 1, 2, 5, 4)
        words = u[..., 0] | (u[..., 1] << 4) | (u[..., 2] << 8) | (u[..., 3] << 12)
        # to int16 wraps words >= 2^15 to the same 16 bits; little-endian bytes
        packed = words.to(torch.int16).contiguous().view(torch.uint8)
    else:
        # step t, sub-block j, byte 2c+p = q[8j+c, 2t+p]
        packed = q.to(torch.int8).view(blocks, 4, 8, k // 2, 2).permute(0, 3, 1, 2, 4)
        packed = packed.contiguous().view(torch.uint8)
    zero = None if codes.zero is None else _blocked(codes.zero, n_pad, AVX2_BLOCK)
    scale = codes.scale if codes.codebook is None else e8m0(codes.scale)  # E8M0 bytes
    return packed, _blocked(scale, n_pad, AVX2_BLOCK), zero


class LowBitLinear:
    """A weight-only int4/int8 (or E2M1 codebook) layer on the native kernel, any batch size.

    ``out_float`` returns float32 (the logits of an int8 ``lm_head``) instead of the
    activation dtype. ``portable`` runs the kernel's scalar reference path (tests);
    ``vnni=False`` keeps every row on the bfloat16 kernel, whose products are exact (no
    kernel that rounds activations to 15 or 16 bits: VNNI, AVX2; tests). ``vnni_rows`` is
    the most rows the VNNI kernel takes for this layer (0: none), ``vnni_codes`` its
    ``(packed, scales, offsets)``. ``avx2``: rows beyond those run on
    :file:`csrc/lowbit_avx2.cpp` (a CPU without AVX512-BF16), whose layout ``packed``,
    ``scales`` and ``zeros`` then hold. ``vnni_copy=False`` keeps one copy of the codes
    (every row count on the first kernel): a mixture's experts, where a second copy
    would double the memory that holding codes instead of bf16 saves."""

    __slots__ = ("packed", "scales", "zeros", "bits", "group_size", "bias", "out_features",
                 "in_features", "out_float", "portable", "_wide", "_vnni", "vnni_rows",
                 "_out_args", "vnni_codes", "avx2", "codebook")

    def __init__(self, codes: AffineCodes, bias: torch.Tensor | None = None, *,
                 out_float: bool = False, portable: bool = False, vnni: bool = True,
                 vnni_copy: bool = True) -> None:
        kernel = lowbit_kernel()
        if kernel is None or not kernel_fits(codes):
            raise ValueError("the low-bit kernel is not available for this layer")
        self.bits, self.group_size, self.codebook = codes.bits, codes.group_size, codes.codebook
        self.out_features, self.in_features = codes.shape
        self._out_args = (self.out_features, self.out_features, int(out_float))
        # without AVX512-BF16, lowbit_gemm.cpp has only its scalar path: the AVX2 kernel
        # takes every row count then (faster than dequantizing to float32 for F.linear
        # up to 256 rows at least, see its header) and its layout is the only copy
        wide = (lowbit_avx2_kernel() if vnni and not portable and not kernel[1]
                and avx2_fits(codes) else None)
        self.avx2 = wide is not None
        if self.avx2:
            self.packed, self.scales, self.zeros = pack_avx2(codes)
            self._wide = self._bind(wide[0], self.packed, self.scales, self.zeros,
                                    self.scales.shape[0])
        else:
            self.packed, self.scales, self.zeros = pack(codes)
            self._wide = self._bind(kernel[0], self.packed, self.scales, self.zeros,
                                    self.packed.shape[0])
        small = (lowbit_vnni_kernel() if vnni and vnni_copy and not portable
                 and vnni_fits(codes) else None)
        self.vnni_codes = None if small is None else pack_vnni(codes)
        self._vnni = None if small is None else self._bind(small[0], *self.vnni_codes,
                                                           self.vnni_codes[1].shape[0])
        self.vnni_rows = 0 if small is None else small[1]
        self.bias = bias
        self.out_float = out_float
        self.portable = portable

    def _bind(self, fn, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
              blocks: int) -> tuple:
        """``(fn, arguments before the row count, arguments after it)``: the tensors are
        attributes of self, so their pointers stay valid as long as the layer does."""
        bits = self.bits if self.codebook is None else FP4_FORMAT
        return (fn, (packed.data_ptr(), bits, scales.data_ptr(),
                     None if zeros is None else zeros.data_ptr()),
                (blocks, self.in_features, self.group_size))

    @property
    def kind(self) -> str:
        return f"int{self.bits}" if self.codebook is None else "fp4"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step makes ~120 of these calls per token, so the per-call Python is
        # kept to a minimum: the constant arguments are bound once in _bind.
        if self.avx2 and x.numel() > self.vnni_rows * self.in_features:
            return self._call_avx2(x)
        if x.dim() == 2 and x.dtype == torch.bfloat16 and x.stride(-1) == 1:
            x2 = x
        else:
            x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
        rows = x2.shape[0]
        out = torch.empty((rows, self.out_features),
                          dtype=torch.float32 if self.out_float else torch.bfloat16)
        if 0 < rows <= self.vnni_rows:
            fn, head, tail = self._vnni
            fn(x2.data_ptr(), x2.stride(0), *head, rows, *tail, out.data_ptr(), *self._out_args,
               torch.get_num_threads())
        elif rows:
            fn, head, tail = self._wide
            fn(x2.data_ptr(), x2.stride(0), *head, rows, *tail, out.data_ptr(), *self._out_args,
               int(self.portable), torch.get_num_threads())
        if not self.out_float and x.dtype != torch.bfloat16:
            out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out if x2 is x else out.reshape(*x.shape[:-1], self.out_features)

    def _call_avx2(self, x: torch.Tensor) -> torch.Tensor:
        """Rows on the AVX2 kernel: float32 and bfloat16 activations go in as they are."""
        if x.dim() == 2 and x.stride(-1) == 1 and x.dtype in _AVX2_INPUTS:
            x2 = x
        else:
            x2 = x.reshape(-1, self.in_features)
            if x2.dtype not in _AVX2_INPUTS:
                x2 = x2.float()
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
        f32 = self.out_float or x2.dtype == torch.float32
        out = torch.empty((x2.shape[0], self.out_features),
                          dtype=torch.float32 if f32 else torch.bfloat16)
        fn, head, tail = self._wide
        fn(x2.data_ptr(), x2.stride(0), int(x2.dtype == torch.float32), *head, x2.shape[0],
           *tail, out.data_ptr(), self.out_features, self.out_features, int(f32),
           torch.get_num_threads())
        if not self.out_float and out.dtype != x.dtype:
            out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out if x2 is x else out.reshape(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        """Bytes one product reads (one layout's codes, scales and offsets, the bias):
        the second layout is resident but a step reads only one of them."""
        return sum(t.numel() * t.element_size()
                   for t in (self.packed, self.scales, self.zeros, self.bias) if t is not None)
