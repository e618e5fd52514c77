"""Linear layers from plain and compressed-tensors checkpoints.

The checkpoint format is the contract with ``llmctl quantize`` (and llm-compressor):
``config.json`` carries ``quantization_config`` with ``quant_method:
"compressed-tensors"``, ``config_groups`` (targets + weight ``QuantizationArgs``),
``ignore`` and a ``format``; per linear layer the checkpoint holds

- ``pack-quantized`` (int weights of 1-8 bits, here 2/4/8): ``weight_packed`` int32
  ``[N, ceil(K*b/32)]``, element ``i`` of a row at bits ``(i*b) % 32`` of word
  ``i*b // 32``, stored as ``q + 2**(b-1)`` (unsigned); ``weight_scale`` ``[N, G]``
  (group) or ``[N, 1]`` (channel); ``weight_shape`` ``(N, K)``; asymmetric schemes add
  ``weight_zero_point`` packed the same way along dim 0 (``[ceil(N*b/32), G]``).
- ``int-quantized``: ``weight`` int8 ``[N, K]`` + ``weight_scale`` (+ zero point).
- ``float-quantized``: ``weight`` float8_e4m3fn ``[N, K]`` + ``weight_scale``.

Dequantization is ``w = (q - zero_point) * scale`` per group of ``group_size`` input
columns. Execution paths, picked per layer (activations in bf16 whatever the model
dtype: "W4A16"):

- int4 and int8, any group that divides the row, on a CPU with AVX512-BF16: llmctl's own
  kernel (:class:`llmctl.serve.layers.lowbit.LowBitLinear`) at every batch size; on a CPU with
  AVX2 + FMA only, the same class on its AVX2 kernel for groups of whole 32-input blocks
  (activations as they come, float32 or bf16). Otherwise:
- int4 -> ``aten._weight_int4pack_mm_for_cpu`` for small batches, whose weights
  dequantize as ``(u - 8) * s + z`` with ``u = q + 8``: so ``z = -zero_point * s``. It
  accepts groups of 32/64/128/256 only: a larger group (or per-channel) repeats its
  scale over sub-groups, which is exact; output features are padded to a multiple of 16.
- int8 per-channel -> ``aten._weight_int8pack_mm`` (``x @ (q * s).T``) for small batches;
  an asymmetric zero point subtracts ``rowsum(x) * zero_point * s``.
- larger batches of both: a bf16 weight dequantized on the fly from the codes (the
  kernels are tuned for decode and slow down ~10x at 128 rows; see KERNEL_MAX_ROWS).
  An int4 layer therefore holds its codes twice, packed for the kernel and two per byte:
  1 byte per weight plus scales, against 2 (bf16) and 4 (fp32).
- everything else (FP8, 2-bit, CUDA; int8 groups without the own kernel) is dequantized once at load into the model
  dtype: smaller on disk, not faster.
- dense bf16 and float32 weights on the CPU (plain or dequantized) are reordered once
  into oneDNN's blocked layout (:class:`PackedLinear`); bf16 where oneDNN cannot pack it
  (AVX2-only CPUs) computes in float32 on the widened weight (:class:`WideningBF16Linear`).
  Activation quantization in a scheme is not applied (weights-only execution);
  :func:`describe` reports which path each layer got.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmctl.errors import UnsupportedArchitectureError
from llmctl.quant.packing import unpack_int32
from llmctl.serve.layers.lowbit import (
    AffineCodes,
    LowBitLinear,
    avx2_available,
    fast_fits,
    interleave_block_pairs,
    simd_available,
)

_INT4_GROUPS = (256, 128, 64, 32)


# --- layers --------------------------------------------------------------------------
class DenseLinear:
    kind = "dense"
    __slots__ = ("weight", "bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.weight, self.bias)


class PackedLinear:
    """A dense bf16 or float32 CPU weight prepared once for this CPU's GEMM, in one or
    two forms:

    - ``own``: :file:`csrc/gemm_bf16.cpp`'s layout (bf16 on a CPU with AVX512-BF16),
      rows of up to ``own_rows`` run there;
    - oneDNN's blocked layout (``mkldnn._reorder_linear_weight``) applied with
      ``mkldnn._linear_pointwise`` (instead of repacking inside every ``F.linear``), for
      larger batches, or for every batch when there is no own form.

    ``gemm`` picks (:func:`llmctl.serve.model.weights.bf16_gemm_plan` decides per model):
    "own" (every batch, one copy of the weight), "onednn", or "both" (own for up to
    :meth:`both_rows` rows, oneDNN above: two copies, as on CPUs with AMX: SMALL_ROWS, or
    AMX_ROWS where the own kernel has the tile unit too). Measurements are in the kernel's header.

    oneDNN against ``F.linear`` (2 threads, SmolLM2's four layer matmuls, interleaved
    A/B): bf16 1.78 vs 2.50 ms per layer at 128 rows, 9.9 vs 10.9 ms at 1024 rows; the
    49k x 576 lm_head at 128 rows 13.5 vs 21.7 ms. float32 over all 30 layers
    (development measurement, cold weights): 24.3 vs 36.4 ms at 1 row, 40.9 vs 69.4 at
    32, 141 vs 222 at 128, 1019 vs 1218 at 1024; the head at 32 rows 9.5 vs 23.6 ms. The
    bf16 weight is packed for 1024-row batches (the hint changes the blocking): the best
    of the hints tried at both 128 and 1024 rows; float32 is indifferent to it.
    """

    kind = "dense"
    __slots__ = ("bias", "in_features", "out_features", "weight", "own", "own_rows",
                 "itemsize")
    BATCH_HINT = 1024
    SMALL_ROWS = 4  # "both": the own kernel's rows (memory-bound: the copy pays there)
    # ... when the own kernel has the AMX tile unit (gemm_bf16.cpp): decode batches stay
    # there, prefill goes to oneDNN. 32: its tiles read a cold weight at 14-19 GB/s up to
    # 32 rows, less steadily past them (development measurement, Intel Xeon guest)
    AMX_ROWS = 32

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *,
                 gemm: str = "onednn") -> None:
        self.out_features, self.in_features = weight.shape
        self.itemsize = weight.element_size()
        self.bias = bias
        self.own = bf16_gemm_layer(weight) if gemm in ("own", "both") else None
        self.own_rows = 0 if self.own is None else (
            sys.maxsize if gemm == "own" else self.both_rows())
        self.weight = (None if self.own_rows == sys.maxsize
                       else torch.ops.mkldnn._reorder_linear_weight(weight, self.BATCH_HINT))

    @classmethod
    def both_rows(cls) -> int:
        """The rows "both" gives the own kernel on this CPU."""
        from llmctl.serve.kernels.cpu import gemm_bf16_amx_rows

        return cls.AMX_ROWS if gemm_bf16_amx_rows() else cls.SMALL_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.own is not None and x.shape[0] <= self.own_rows and x.dim() == 2 \
                and x.dtype == torch.bfloat16 and x.stride(-1) == 1:
            out = self.own(x)
            return out if self.bias is None else out + self.bias
        if self.weight is None:  # own only: a 3-D or strided input
            flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
            return self(flat).view(
                *x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    @property
    def nbytes(self) -> int:
        """The weight as used (one copy), not the memory held (two with "both")."""
        return self.out_features * self.in_features * self.itemsize + _nbytes(self.bias)


class GemmBF16:
    """A bf16 weight in :file:`csrc/gemm_bf16.cpp`'s layout (see there), any rows."""

    __slots__ = ("packed", "out_features", "in_features", "blocks", "_fn")

    def __init__(self, weight: torch.Tensor, fn) -> None:
        # step t, block j: element 2c+p = w[c, 2t+p]
        self.packed = interleave_block_pairs(weight.to(torch.bfloat16), 2).contiguous()
        self.out_features, self.in_features = weight.shape
        self.blocks, self._fn = 2 * self.packed.shape[0], fn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        out = torch.empty((rows, self.out_features), dtype=torch.bfloat16)
        if rows:
            self._fn(x.data_ptr(), x.stride(0), self.packed.data_ptr(), rows, self.blocks,
                     self.in_features, out.data_ptr(), self.out_features, self.out_features,
                     torch.get_num_threads())
        return out


class WideningBF16Linear(DenseLinear):
    """A dense bf16 CPU weight where oneDNN cannot pack bf16 and torch emulates bf16
    products (AVX2-only CPUs such as Zen 3): rows of up to :attr:`KERNEL_MAX_ROWS` run
    :file:`csrc/gemv_bf16_avx2.cpp`, which widens the weight to float32 in registers and
    reads it in torch's layout (one copy); larger batches run ``F.linear`` in float32 on a
    weight widened per call (2 bytes -> 4 per weight, cheap next to a product of that many
    rows). Sums are float32 either way, the bias added in float32, one rounding to the
    activations' dtype at the end."""

    __slots__ = ("_fn",)
    # Where the kernel stops beating float32 F.linear on the weight widened per call
    # (1536 x 576, 1 thread, Zen 3 under a background load, development measurement):
    # 0.10 / 0.21 / 0.55 / 0.87 / 1.30 ms against 0.31 / 0.58 / 0.71 / 0.85 / 1.02 ms at
    # 1 / 4 / 8 / 12 / 16 rows: a tie at 12, where the kernel still saves the widened
    # copy's allocation.
    KERNEL_MAX_ROWS = 12

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fn) -> None:
        super().__init__(weight.contiguous(), bias)
        self._fn = fn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.weight.shape
        x2 = x.reshape(-1, k)
        rows = x2.shape[0]
        if rows > self.KERNEL_MAX_ROWS or x2.dtype not in (torch.bfloat16, torch.float32):
            bias = None if self.bias is None else self.bias.float()
            y = F.linear(x2.float(), self.weight.float(), bias).to(x.dtype)
            return y.view(*x.shape[:-1], n)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        # with a bias the kernel's float32 sums take it before the one rounding
        narrow = x2.dtype == torch.bfloat16 and self.bias is None
        out = torch.empty((rows, n), dtype=torch.bfloat16 if narrow else torch.float32)
        if rows:
            self._fn(x2.data_ptr(), x2.stride(0), int(x2.dtype == torch.bfloat16),
                     self.weight.data_ptr(), rows, n, k, out.data_ptr(), n, int(narrow),
                     torch.get_num_threads())
        if self.bias is not None:
            out += self.bias.float()
        return out.to(x.dtype).view(*x.shape[:-1], n)


def widening_bf16_layer(weight: torch.Tensor, bias: torch.Tensor | None):
    """:class:`WideningBF16Linear` for a bf16 CPU weight, or None (another dtype or
    device, native kernels off, no AVX2 + FMA build)."""
    from llmctl.serve.kernels.cpu import gemm_bf16w_avx2_kernel, native_enabled

    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not native_enabled():
        return None
    fn = gemm_bf16w_avx2_kernel()
    return None if fn is None else WideningBF16Linear(weight, bias, fn)


def bf16_gemm_layer(weight: torch.Tensor) -> GemmBF16 | None:
    """The own-kernel form of a bf16 CPU weight, or None (no kernel on this CPU, odd
    width)."""
    from llmctl.serve.kernels.cpu import gemm_bf16_kernel

    kernel = gemm_bf16_kernel()
    if kernel is None or weight.dtype != torch.bfloat16 or weight.shape[1] % 2:
        return None
    return GemmBF16(weight, kernel)


def packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether dense layers of this dtype/device become :class:`PackedLinear`."""
    from llmctl.serve.kernels.cpu import native_enabled

    return (dtype in (torch.bfloat16, torch.float32) and device.type == "cpu" and native_enabled()
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and (dtype != torch.bfloat16 or onednn_bf16_supported()))


def onednn_bf16_supported() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU: it needs AVX512-BW/VL/DQ or
    AVX-NE-CONVERT, and its reorder raises "bf16 path needs the cpu support ..." on an
    AVX2-only CPU (AMD Zen 3), where bf16 layers stay plain ``F.linear`` (emulated)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe is not None and probe())


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None, *, gemm: str = "onednn"):
    """The dense layer for a weight already in its device and dtype (``gemm``: see
    :class:`PackedLinear`; float32 weights take oneDNN whatever it says)."""
    if packing_available(weight.dtype, weight.device):
        return PackedLinear(weight, bias,
                            gemm=gemm if weight.dtype == torch.bfloat16 else "onednn")
    widening = widening_bf16_layer(weight, bias)  # bf16 that oneDNN cannot pack
    return widening if widening is not None else DenseLinear(weight, bias)


# Measured on this machine's CPU (one thread, a 1536 x 576 layer): the int4 kernel takes
# 79 us at 1 row (dense bf16: 245 us) but 7.4 ms at 128 rows (dense bf16: 0.9 ms), and
# runs 30-50x slower with float32 activations; the int8 kernel behaves alike. So rows of
# up to KERNEL_MAX_ROWS (decode batches) go through the kernels in bf16, and larger
# batches (prefill chunks, big decode batches) through a bf16 weight dequantized on the
# fly from the codes, which costs ~0.8 ms per layer and keeps memory low.
KERNEL_MAX_ROWS = 24


class _LowBitLinear:
    """Shared by the int4 and int8 layers: the batch-size policy, and (int8) the codes ``q``
    with per-group scale and zero from which large batches dequantize."""

    __slots__ = ("q", "scale", "zero", "group_size", "bias", "out_features", "in_features",
                 "act_dtype")
    kind = "lowbit"

    def _init_codes(self, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                    group_size: int, bias: torch.Tensor | None, act_dtype: torch.dtype) -> None:
        self.q = q.to(torch.int8).contiguous()
        self.scale = scale.to(act_dtype).contiguous()
        self.zero = None if zero_point is None else zero_point.to(act_dtype).contiguous()
        self.group_size = group_size
        self.bias = bias
        self.out_features, self.in_features = q.shape
        self.act_dtype = act_dtype

    def dequantized(self) -> torch.Tensor:
        """``(q - zero_point) * scale`` as an activation-dtype weight ``[N, K]``."""
        n, k = self.q.shape
        w = self.q.view(n, -1, self.group_size).to(self.act_dtype)
        if self.zero is not None:
            w = w - self.zero.unsqueeze(-1)
        return (w * self.scale.unsqueeze(-1)).view(n, k)

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != self.act_dtype:
            x2 = x2.to(self.act_dtype)
        if x2.shape[0] <= KERNEL_MAX_ROWS:
            y = self._kernel(x2)
        else:
            y = F.linear(x2, self.dequantized())
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


class Int4Linear(_LowBitLinear):
    """Weight-only int4: torch's CPU tinygemm-style kernel for small batches.

    The kernel's packed layout is private to torch, so the large-batch path keeps its own
    copy of the codes, two per byte (``u = q + 8``), and shares the kernel's scales and
    zeros: 1 byte per weight plus scales, against 2 (bf16) and 4 (fp32)."""

    kind = "int4"
    __slots__ = ("packed", "scales_zeros", "kernel_group", "nibbles")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                 group_size: int, bias: torch.Tensor | None, act_dtype: torch.dtype) -> None:
        n, k = q.shape
        self.group_size, self.bias, self.act_dtype = group_size, bias, act_dtype
        self.out_features, self.in_features = n, k
        sub = kernel_group_size(k, group_size)
        reps = group_size // sub
        scale = scale.float().repeat_interleave(reps, dim=1)
        zero = (torch.zeros_like(scale) if zero_point is None
                else -zero_point.float().repeat_interleave(reps, dim=1) * scale)
        u = (q.to(torch.int32) + 8)
        self.nibbles = (u[:, 0::2] | (u[:, 1::2] << 4)).to(torch.uint8).contiguous()
        pad = -n % 16
        if pad:
            u = torch.cat([u, torch.full((pad, k), 8, dtype=torch.int32)])
            scale = torch.cat([scale, torch.ones(pad, scale.shape[1])])
            zero = torch.cat([zero, torch.zeros(pad, zero.shape[1])])
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), 2)
        self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(act_dtype)
        self.kernel_group = sub

    def dequantized(self) -> torch.Tensor:
        """``(u - 8) * s + z`` per kernel group, as an activation-dtype weight ``[N, K]``."""
        n, k = self.out_features, self.in_features
        u = torch.stack([self.nibbles & 15, self.nibbles >> 4], dim=-1).view(n, -1,
                                                                              self.kernel_group)
        sz = self.scales_zeros[:, :n].transpose(0, 1)  # [N, groups, 2]
        w = (u.to(self.act_dtype) - 8) * sz[..., :1] + sz[..., 1:]
        return w.view(n, k)

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.kernel_group,
                                                       self.scales_zeros)
        return y[:, :self.out_features]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.packed, self.scales_zeros, self.nibbles, self.bias)


class Int8Linear(_LowBitLinear):
    """Weight-only int8 per output channel: ``aten._weight_int8pack_mm`` for small batches
    (``x @ (q * s).T``; an asymmetric zero point subtracts ``rowsum(x) * zero_point * s``)."""

    kind = "int8"
    __slots__ = ("channel_scale", "zero_scale")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                 bias: torch.Tensor | None, act_dtype: torch.dtype) -> None:
        self._init_codes(q, scale.reshape(-1, 1), None if zero_point is None
                         else zero_point.reshape(-1, 1), q.shape[1], bias, act_dtype)
        self.channel_scale = self.scale.reshape(-1)
        self.zero_scale = None
        if zero_point is not None:
            self.zero_scale = (zero_point.reshape(-1).float()
                               * scale.reshape(-1).float()).to(act_dtype)

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x2, self.q, self.channel_scale)
        if self.zero_scale is not None:
            y = y - x2.sum(-1, keepdim=True) * self.zero_scale
        return y

    @property
    def nbytes(self) -> int:
        return _nbytes(self.q, self.scale, self.zero, self.bias)


class ConcatLinear:
    """Several linears on the same input whose outputs are concatenated (unfusable parts)."""

    __slots__ = ("parts",)
    kind = "concat"

    def __init__(self, parts: list) -> None:
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def kernel_group_size(in_features: int, group_size: int) -> int:
    """The largest group the int4 kernel accepts that divides ``group_size`` (0 if none)."""
    for size in _INT4_GROUPS:
        if group_size % size == 0 and in_features % size == 0:
            return size
    return 0


# --- weights as loaded ------------------------------------------------------------------
@dataclass
class QuantWeight:
    """Integer weights of one layer: ``w = (q - zero_point) * scale`` per group."""

    q: torch.Tensor  # int8 [N, K], signed
    scale: torch.Tensor  # [N, G]
    zero_point: torch.Tensor | None  # [N, G] or None (symmetric)
    group_size: int
    num_bits: int

    def affine(self) -> AffineCodes | None:
        """The same weights as the low-bit kernel's codes (4 and 8 bits; else None)."""
        scale = self.scale.float()
        zp = None if self.zero_point is None else self.zero_point.float()
        if self.num_bits == 4:  # u = q + 8 in 0..15: w = s (u - 8 - zp)
            return AffineCodes((self.q.to(torch.int16) + 8).to(torch.uint8), scale,
                               -scale * (8 + (0 if zp is None else zp)), self.group_size, 4)
        if self.num_bits == 8:
            return AffineCodes(self.q.to(torch.int8), scale, None if zp is None else -scale * zp,
                               self.group_size, 8)
        return None

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        n, k = self.q.shape
        q = self.q.float().view(n, -1, self.group_size)
        if self.zero_point is not None:
            q = q - self.zero_point.float().unsqueeze(-1)
        return (q * self.scale.float().unsqueeze(-1)).view(n, k).to(dtype)


def _group_scale(scale: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, int]:
    """Scale as ``[N, G]`` and the group size (channel and tensor strategies included)."""
    if scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(n, 1)
    scale = scale.reshape(n, -1)
    return scale, k // scale.shape[1]


def load_quant_weight(get, name: str, args: dict, fmt: str) -> QuantWeight | torch.Tensor:
    """Read one layer's quantized tensors (``get(tensor_name)``) into a QuantWeight.

    FP8 (``float-quantized``) comes back as a float32 tensor, already dequantized.
    """
    scale = get(f"{name}.weight_scale")
    num_bits = int(args.get("num_bits", 8))
    if fmt == "float-quantized":
        w = get(f"{name}.weight").float()
        n, k = w.shape
        scale, group = _group_scale(scale.float(), n, k)
        return (w.view(n, -1, group) * scale.unsqueeze(-1)).view(n, k)
    zp = None
    if fmt == "pack-quantized":
        n, k = (int(v) for v in get(f"{name}.weight_shape").tolist())
        q = unpack_int32(get(f"{name}.weight_packed"), num_bits, (n, k))
        scale, group = _group_scale(scale, n, k)
        if not args.get("symmetric", True):
            zp = get(f"{name}.weight_zero_point")  # packed along the output rows
            zp = unpack_int32(zp, num_bits, (n, zp.shape[1]), dim=0)
    elif fmt in ("int-quantized", "naive-quantized"):
        q = get(f"{name}.weight").to(torch.int8)
        n, k = q.shape
        scale, group = _group_scale(scale, n, k)
        if not args.get("symmetric", True):
            zp = get(f"{name}.weight_zero_point").to(torch.int8).reshape(n, -1)
    else:
        raise UnsupportedArchitectureError(
            f"{name}: compressed-tensors format {fmt!r} is not supported by the engine",
            "use pack-quantized (int4/int8), int-quantized or float-quantized (FP8) checkpoints")
    if zp is not None and zp.shape != scale.shape:
        zp = zp.expand_as(scale)
    return QuantWeight(q=q, scale=scale, zero_point=zp, group_size=group, num_bits=num_bits)


def concat_quant(parts: list[QuantWeight]) -> QuantWeight | None:
    """Fuse layers sharing an input (q/k/v, gate/up) if their schemes line up."""
    first = parts[0]
    if any(p.group_size != first.group_size or p.num_bits != first.num_bits
           or (p.zero_point is None) != (first.zero_point is None) for p in parts):
        return None
    return QuantWeight(
        q=torch.cat([p.q for p in parts]), scale=torch.cat([p.scale for p in parts]),
        zero_point=None if first.zero_point is None else torch.cat([p.zero_point for p in parts]),
        group_size=first.group_size, num_bits=first.num_bits)


def kernel_linear(weight: QuantWeight | AffineCodes, bias: torch.Tensor | None, *,
                  backend: str, device: torch.device,
                  one_copy: bool = False) -> LowBitLinear | None:
    """``weight`` as a :class:`LowBitLinear` where the engine runs low-bit layers on the
    native kernel (``backend == "kernel"`` on a CPU with a SIMD body built, a layout that
    :func:`fast_fits`), else None: the one decision of dense layers and of a mixture's
    experts. ``one_copy``: without the VNNI kernel's second layout (``vnni_copy``)."""
    if backend != "kernel" or device.type != "cpu" or not (simd_available() or avx2_available()):
        return None
    codes = weight if isinstance(weight, AffineCodes) else weight.affine()
    if codes is None or not fast_fits(codes):
        return None
    return LowBitLinear(codes, bias, vnni_copy=not one_copy)


def make_linear(weight: QuantWeight | torch.Tensor, bias: torch.Tensor | None, *,
                dtype: torch.dtype, device: torch.device, backend: str,
                gemm: str = "onednn"):
    """The fastest layer this machine has for ``weight`` (see the module docstring)."""
    if bias is not None:
        bias = bias.to(device=device, dtype=dtype)
    if isinstance(weight, torch.Tensor):
        return dense_linear(weight.to(device=device, dtype=dtype).contiguous(), bias,
                            gemm=gemm)
    fast = kernel_linear(weight, bias, backend=backend, device=device)
    if fast is not None:
        return fast
    kernels = backend == "kernel" and device.type == "cpu"
    if isinstance(weight, AffineCodes):
        return dense_linear(weight.dequantize(dtype).to(device).contiguous(), bias)
    # low-bit layers compute in bf16 (or fp16) whatever the model dtype: "W4A16"
    act = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    if kernels and weight.num_bits == 4 and kernel_group_size(weight.q.shape[1], weight.group_size):
        return Int4Linear(weight.q, weight.scale, weight.zero_point, weight.group_size, bias, act)
    if kernels and weight.num_bits == 8 and weight.scale.shape[1] == 1:
        return Int8Linear(weight.q, weight.scale, weight.zero_point, bias, act)
    return dense_linear(weight.dequantize(dtype).to(device).contiguous(), bias)


def describe(layers: dict[str, object]) -> dict[str, int]:
    """How many layers run on each path (``{"int4": 210, "dense": 1}``)."""
    counts: dict[str, int] = {}
    for layer in layers.values():
        parts = layer.parts if isinstance(layer, ConcatLinear) else [layer]
        for part in parts:
            counts[part.kind] = counts.get(part.kind, 0) + 1
    return counts
