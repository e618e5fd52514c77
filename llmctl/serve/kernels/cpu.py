"""Native CPU kernels: built from ``csrc/`` on first use, loaded with ctypes.

- :file:`csrc/paged_attention.cpp` reads K/V in place through the block tables (float32,
  bf16, or int8 / fp8 codes with their scales: :mod:`llmctl.serve.layers.kv_quant`); the pure-torch
  fallback gathers them into a padded copy first, which costs three passes over the
  cache instead of one (the decode step of a 128-sequence batch spent two thirds of its
  time there).
- :file:`csrc/norm_act.cpp`: residual add + RMSNorm, SwiGLU's ``silu(g) * u`` and GeGLU's
  ``gelu_tanh(g) * u`` for bfloat16 activations in one pass each, with transformers'
  roundings (torch's bf16 RMSNorm alone cost a fifth of the matrix products' time on a
  prefill step).
- :file:`csrc/lowbit_gemm.cpp`: int4/int8 weights times bfloat16 activations with
  AVX512-BF16 (:mod:`llmctl.serve.layers.lowbit`); :file:`csrc/lowbit_vnni.cpp` the same for
  one to eight rows with AVX512-VNNI byte products on 15-bit activations;
  :file:`csrc/lowbit_avx2.cpp` on AVX2 + FMA (no AVX-512) with 16-bit products on 16-bit
  activations, tuned for one to eight rows.
- :file:`csrc/gemm_bf16.cpp`: dense bfloat16 weights times any number of rows
  (:class:`llmctl.serve.layers.quant_linear.PackedLinear`'s own kernel).
- :file:`csrc/gemv_bf16_avx2.cpp`: dense bfloat16 weights in torch's own layout times a
  few rows on AVX2 + FMA, widened to float32 in registers (CPUs where oneDNN cannot pack
  bf16 and torch emulates its products: :class:`llmctl.serve.layers.quant_linear.WideningBF16Linear`).
- :file:`csrc/decode_layer.cpp`: a whole decoder layer for a decode step in one
  call, from the kernels above (:mod:`llmctl.serve.layers.decode_layers`): the AVX512-BF16 /
  VNNI matrix kernels, or on AVX2-only CPUs the widening bf16 and AVX2 low-bit ones.
- :file:`csrc/prefill_attention.cpp`: causal attention of fresh prompts (bf16), both
  products as small GEMMs on vdpbf16ps (torch's SDPA flash kernel took twice as long).
- :file:`csrc/rope_kv.cpp`: RoPE on a step's q and k and the K/V cache write in one
  pass for bfloat16 (nine torch ops per layer before), quantizing for an int8 or fp8 cache.
- :file:`csrc/lora.cpp`: the LoRA terms of a fused linear for bfloat16 activations, per
  adapter row range (:mod:`llmctl.serve.lora.batch`), for the layer loop and the fused
  decode layers alike.
- :file:`csrc/simd_math.h`: bf16 <-> float32 and the vectorised exp both use;
  :file:`csrc/fp8.h`: E4M3 <-> float32 and bf16.

On aarch64 paged attention and the bf16 norm/activation have NEON bodies, in both the
``native`` and the ``portable`` build (ARMv8-A's baseline includes NEON); they are checked
for correctness under qemu-user only (``tests/serve/kernels/test_kernel_cross.py``): their speed
on ARM is not measured.

Built with the system C++ compiler (``$CXX``, else ``c++``), ``-O3 -march=native
-fopenmp``, into ``$LLMCTL_HOME/kernels/`` under a name that hashes the source, the
flags, the compiler's version and the CPU's feature flags. ``$LLMCTL_KERNEL_ISA`` builds a
named instruction-set variant instead (:data:`VARIANTS`: ``avx512-bf16``, ``avx512``,
``avx2``, ``portable``), so one machine can run every body its CPU supports (the kernel
tests do), so a changed source or a
different machine sharing the cache never loads a stale or illegal binary. The C ABI
needs no torch headers; the units compile side by side, one compiler process per core
(a first build waits for the longest unit, then it is cached). The library links ``libgomp``,
the OpenMP runtime torch itself loads, so both share one thread pool.

No compiler, a failed build or ``LLMCTL_CPU_KERNELS=0``: :func:`paged_attention_kernel`
and :func:`norm_act_kernels` return None and the model takes the torch path (same
results to float tolerance).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import torch

from llmctl.home import llmctl_home
from llmctl.utils.cpu import cpu_flags, usable_cpus

log = logging.getLogger("llmctl.serve")

# Everything the library is built from, all hashed into its file name (so editing the
# header rebuilds too); the .cpp files are the compiler's inputs.
SOURCES = tuple(Path(__file__).parent / "csrc" / name
                for name in ("paged_attention.cpp", "norm_act.cpp", "lowbit_gemm.cpp",
                             "lowbit_vnni.cpp", "lowbit_avx2.cpp", "gemm_bf16.cpp",
                             "rope_kv.cpp", "decode_layer.cpp", "prefill_attention.cpp",
                             "lora.cpp", "gemv_bf16_avx2.cpp", "simd_math.h", "fp8.h",
                             "lora.h"))
FLAGS = ("-O3", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# Instruction-set variants: name -> (the compiler's target flags, the /proc/cpuinfo flags a
# CPU needs to run the binary). "native" (the default) targets the building CPU, so each
# machine gets its best bodies; the named x86 ones let a machine build and test every body
# it can run (an AVX-512 box runs the AVX2 and portable ones too). x86-64-v3 is AVX2 +
# FMA + F16C + BMI1/2 + LZCNT + MOVBE; v4 adds AVX-512 F/BW/CD/DQ/VL.
_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
VARIANTS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "native": (("-march=native",), frozenset()),
    "avx512-bf16": (("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
                    _V4 | {"avx512_bf16", "avx512_vnni"}),
    "avx512": (("-march=x86-64-v4",), _V4),
    "avx2": (("-march=x86-64-v3",), _V3),
    "portable": ((), frozenset()),  # the compiler's baseline (SSE2 on x86-64)
}
X86_VARIANTS = ("avx512-bf16", "avx512", "avx2", "portable")
VARIANT_ENV = "LLMCTL_KERNEL_ISA"
# (query dtype, 8-bit cache's storage or None) -> exported symbol; a float cache has the
# queries' dtype; int8 codes, or uint8 holding E4M3 codes (llmctl.serve.layers.kv_quant)
SYMBOLS = {(torch.float32, None): "paged_attention_f32",
           (torch.bfloat16, None): "paged_attention_bf16",
           (torch.float32, torch.int8): "paged_attention_f32_i8",
           (torch.bfloat16, torch.int8): "paged_attention_bf16_i8",
           (torch.float32, torch.uint8): "paged_attention_f32_f8",
           (torch.bfloat16, torch.uint8): "paged_attention_bf16_f8"}
_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_PAGED_ARGS = [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64,
               _F32, _PTR, _INT, _I64, _F32, _PTR]
# 8-bit caches: the K and V scales follow the K and V codes
_PAGED_I8_ARGS = _PAGED_ARGS[:3] + [_PTR, _PTR] + _PAGED_ARGS[3:]
_ROPE_KV_ARGS = [_PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR,
                 _PTR, _INT]
_ROPE_KV_I8_ARGS = _ROPE_KV_ARGS[:-1] + [_PTR, _PTR, _INT]
ARGTYPES = {
    "paged_attention_f32": _PAGED_ARGS,
    "paged_attention_bf16": _PAGED_ARGS,
    "paged_attention_f32_i8": _PAGED_I8_ARGS,
    "paged_attention_bf16_i8": _PAGED_I8_ARGS,
    "paged_attention_f32_f8": _PAGED_I8_ARGS,
    "paged_attention_bf16_f8": _PAGED_I8_ARGS,
    "add_rms_norm_bf16": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT],
    "silu_mul_bf16": [_PTR, _PTR, _I64, _I64, _INT],
    "gelu_tanh_mul_bf16": [_PTR, _PTR, _I64, _I64, _INT],
    "rms_norm_groups_bf16": [_PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _F32, _INT],
    "lowbit_gemm": [_PTR, _I64, _PTR, _INT, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64,
                    _I64, _INT, _INT, _INT],
    "lowbit_simd": [],
    "lowbit_gemv_vnni": [_PTR, _I64, _PTR, _INT, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64,
                         _I64, _INT, _INT],
    "lowbit_vnni_rows": [],
    "lowbit_gemv_avx2": [_PTR, _I64, _INT, _PTR, _INT, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR,
                         _I64, _I64, _INT, _INT],
    "lowbit_avx2_rows": [],
    "gemm_bf16": [_PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _INT],
    "gemm_bf16_available": [],
    "gemm_bf16_amx_rows": [],
    "gemm_bf16w_avx2": [_PTR, _I64, _INT, _PTR, _I64, _I64, _I64, _PTR, _I64, _INT, _INT],
    "gemm_bf16w_avx2_available": [],
    "decode_layer_bf16": [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64],
    "prefill_attention_bf16": [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64,
                               _F32, _PTR, _I64, _INT, _I64, _F32, _PTR],
    "prefill_attention_available": [],
    "rope_kv_bf16": _ROPE_KV_ARGS,
    "rope_kv_bf16_i8": _ROPE_KV_I8_ARGS,
    "rope_kv_bf16_f8": _ROPE_KV_I8_ARGS,
    "lora_add_bf16": [_PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _INT],
}
RESTYPES = {"lowbit_simd": ctypes.c_int, "lowbit_vnni_rows": ctypes.c_int,
            "lowbit_avx2_rows": ctypes.c_int,
            "gemm_bf16_available": ctypes.c_int, "gemm_bf16_amx_rows": ctypes.c_int,
            "gemm_bf16w_avx2_available": ctypes.c_int,
            "prefill_attention_bf16": ctypes.c_int,
            "prefill_attention_available": ctypes.c_int}


def _compiler() -> str | None:
    cxx = os.environ.get("CXX") or "c++"
    return shutil.which(cxx)


def supported_variants(flags: frozenset[str] | None = None,
                       machine: str | None = None) -> list[str]:
    """The named variants this CPU can run, best first ("portable" everywhere; the x86 ones
    only on x86-64 with their flags)."""
    flags = cpu_flags() if flags is None else flags
    if (machine or platform.machine()) not in ("x86_64", "AMD64"):
        return ["portable"]
    return [name for name in X86_VARIANTS if VARIANTS[name][1] <= flags]


def native_variant(flags: frozenset[str] | None = None, machine: str | None = None) -> str:
    """Which named variant's bodies the default ("native") build compiles in here."""
    return supported_variants(flags, machine)[0]


def selected_variant() -> str:
    """``$LLMCTL_KERNEL_ISA`` (default "native"); an unknown name or one this CPU cannot
    run is an error that lists the ones it can."""
    name = os.environ.get(VARIANT_ENV, "native") or "native"
    if name != "native" and name not in supported_variants():
        from llmctl.errors import UsageError

        raise UsageError(f"{VARIANT_ENV}={name}: not a kernel variant this CPU runs",
                         f"use native or one of: {', '.join(supported_variants())}")
    return name


_VARIANT_WHY = {"avx512-bf16": "AVX-512 with BF16 and VNNI",
                "avx512": "AVX-512 (F/BW/CD/DQ/VL) without BF16 or VNNI",
                "avx2": "AVX2 + FMA + F16C, no AVX-512",
                "portable": "x86-64 without AVX2 + FMA: scalar loops"}
# aarch64's one build: NEON bodies for paged attention and the norm/activation kernels
# (csrc/paged_attention.cpp, csrc/norm_act.cpp), scalar loops for the rest
_AARCH64_WHY = "aarch64: NEON paged attention and norm/activation, scalar loops elsewhere"


def describe_variant() -> dict[str, object]:
    """Which kernel build the engine uses and why (``llmctl hw show``): the selected
    variant, the bodies it compiles in, and every variant this CPU can run."""
    selected = os.environ.get(VARIANT_ENV, "native") or "native"
    runs = supported_variants()
    bodies = runs[0] if selected == "native" else selected
    if not native_enabled():
        why = "LLMCTL_CPU_KERNELS=0: every native kernel is off (torch paths)"
    elif selected == "native":
        arm = platform.machine() in ("aarch64", "arm64")
        why = f"-march=native on this CPU: {_AARCH64_WHY if arm else _VARIANT_WHY[bodies]}"
    else:
        why = f"{VARIANT_ENV}={selected}" + ("" if selected in runs else
                                             " (this CPU cannot run it: an error at load)")
    return {"variant": selected, "bodies": bodies, "why": why, "cpu_runs": runs}


def _build(cxx: str, variant: str = "native") -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             check=False).stdout
    flags = (*FLAGS, *VARIANTS[variant][0])
    key = hashlib.sha256("\0".join([*(src.read_text() for src in SOURCES), " ".join(flags),
                                    version, " ".join(sorted(cpu_flags()))]).encode()).hexdigest()[:16]
    out_dir = llmctl_home() / "kernels"
    target = out_dir / f"llmctl_cpu-{variant}-{key}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".llmctl_cpu-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        compile_units(cxx, flags, [src for src in SOURCES if src.suffix == ".cpp"], tmp, out_dir)
        os.replace(tmp, target)  # concurrent builders each rename a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def compile_units(cxx: str, flags: tuple[str, ...] | list[str], units: list[Path], out: str,
                  work_root: Path | None = None) -> None:
    """Each translation unit compiled in its own compiler process, as many at once as the
    CPU has cores, then one link into ``out`` (``flags`` say what: ``-shared`` here, an
    executable for the tests' drivers): one ``c++`` call with every unit compiles them
    one after another. The largest units start first so no long one is left running
    alone at the end. A failure raises RuntimeError with the compiler's message."""
    units = sorted(units, key=lambda src: Path(src).stat().st_size, reverse=True)
    with tempfile.TemporaryDirectory(prefix=".llmctl_cpu-objs-", dir=work_root) as work:
        objects = [str(Path(work) / f"{i}-{Path(src).stem}.o") for i, src in enumerate(units)]
        commands = [[cxx, *flags, "-c", "-o", obj, str(src)]
                    for src, obj in zip(units, objects, strict=True)]
        with ThreadPoolExecutor(max_workers=usable_cpus()) as pool:
            procs = list(pool.map(_run_compiler, commands))
        if all(p.returncode == 0 for p in procs):
            procs.append(_run_compiler([cxx, *flags, "-o", out, *objects]))
        failed = [p for p in procs if p.returncode != 0]
        if failed:
            raise RuntimeError(failed[0].stderr.strip()[-2000:])


def _run_compiler(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, check=False)


def native_enabled() -> bool:
    """``LLMCTL_CPU_KERNELS=0`` turns off every native CPU path: these kernels and the
    oneDNN weight packing of :class:`llmctl.serve.layers.quant_linear.PackedLinear`."""
    return os.environ.get("LLMCTL_CPU_KERNELS", "1").lower() not in ("0", "false", "no", "off")


def _library() -> ctypes.CDLL | None:
    """The kernels of the selected variant (:func:`selected_variant`), or None."""
    if not native_enabled():
        return None
    return load_variant(selected_variant())


@cache
def load_variant(variant: str) -> ctypes.CDLL | None:
    """Build (once per source, flags, compiler and CPU) and load one variant, or None
    without a compiler or when the build fails."""
    cxx = _compiler()
    if cxx is None:
        log.info("no C++ compiler found: attention and norms run on the torch path")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cxx, variant)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("building the CPU kernels failed, using the torch path: %s", exc)
        return None
    for name, argtypes in ARGTYPES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = RESTYPES.get(name)
    return lib


def paged_attention_kernel(device: torch.device, dtype: torch.dtype,
                           codes: torch.dtype | None = None):
    """The native kernel for this cache device and query dtype (= the cache's, unless
    ``codes``: an 8-bit cache's storage, int8 or uint8 for fp8, read with its scales), or
    None (use the torch path).

    The returned callable takes ``(q, layer_cache, block_tables, context_lens, q_len,
    scale, window=0, scales=None, softcap=0.0, sinks=None)``: ``q [B * q_len, heads, d]``
    (rows of one token may be strided apart, each head's ``d`` values contiguous),
    ``layer_cache [2, blocks, block_size, kv_heads, d]`` contiguous, ``block_tables [B,
    max_blocks]`` and ``context_lens [B]`` int64 (context including this step's tokens),
    ``window`` a sliding window (0: none; the query at ``p`` sees keys ``p - window + 1 .. p``, and
    blocks wholly before the first query's window are never read), ``scales`` an int8
    cache's ``[2, blocks, block_size, kv_heads]`` or an fp8 cache's ``[2, kv_heads]``
    float32, ``softcap`` Gemma 2's logit soft-cap (each scaled score ``s`` becomes
    ``softcap * tanh(s / softcap)`` before the softmax; 0 or None: none), ``sinks``
    gpt-oss's attention sinks (float32 ``[heads]``, one logit per query head in each
    softmax's denominator, :func:`sink_pointer`; None: none); it returns float32
    ``[B * q_len, heads * d]``.
    """
    if torch.device(device).type != "cpu" or (dtype, codes) not in SYMBOLS:
        return None
    lib = _library()
    if lib is None:
        return None
    fn = getattr(lib, SYMBOLS[dtype, codes])
    quantized = codes is not None

    def run(q: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor,
            context_lens: torch.Tensor, q_len: int, scale: float,
            window: int = 0, scales: torch.Tensor | None = None,
            softcap: float | None = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        tokens, heads, d = q.shape
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        out = torch.empty((tokens, heads * d), dtype=torch.float32)
        _, _, block_size, kv_heads, _ = layer_cache.shape
        kv = (layer_cache[0].data_ptr(), layer_cache[1].data_ptr())
        if quantized:
            kv += (scales[0].data_ptr(), scales[1].data_ptr())
        fn(q.data_ptr(), *kv, block_tables.data_ptr(), block_tables.shape[1],
           context_lens.data_ptr(), block_tables.shape[0], q_len, q.stride(0), heads, kv_heads,
           d, block_size, scale, out.data_ptr(), torch.get_num_threads(), window,
           softcap or 0.0, sink_pointer(sinks, heads))
        return out

    return run


def sink_pointer(sinks: torch.Tensor | None, heads: int) -> int | None:
    """The address the kernels read ``heads`` float32 sink logits at (None: no sinks).
    The kernels index it by query head with no check of their own, so a tensor of another
    dtype, length or layout is an error here rather than a wrong read there."""
    if sinks is None:
        return None
    if sinks.dtype != torch.float32 or sinks.shape != (heads,) or not sinks.is_contiguous():
        raise ValueError(f"attention sinks must be contiguous float32 [{heads}], got "
                         f"{sinks.dtype} {tuple(sinks.shape)}")
    return sinks.data_ptr()


def prefill_attention_kernel(device: torch.device, dtype: torch.dtype):
    """:file:`csrc/prefill_attention.cpp` for a bf16 CPU step, or None.

    The callable takes ``(q, k, v, num_seqs, q_len, scale, window=0, softcap=0.0,
    sinks=None)``: ``q [B * q_len, heads, d]``, ``k, v [B * q_len, kv_heads, d]`` (token
    rows may be strided apart, each token's heads contiguous), the causal attention of B
    fresh sequences of ``q_len`` tokens (with ``window`` > 0: query ``i`` sees keys ``i -
    window + 1 .. i``; ``softcap`` and ``sinks`` as :func:`paged_attention_kernel` takes
    them); it returns bf16 ``[B * q_len, heads * d]``, or None for a shape it does not
    take (head_dim other than 64/128), which the caller runs on its other path.
    """
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return None
    lib = _library()
    if lib is None or not lib.prefill_attention_available():
        return None
    fn = lib.prefill_attention_bf16

    def packed(t: torch.Tensor) -> torch.Tensor:  # each token's heads contiguous
        return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int, q_len: int,
            scale: float, window: int = 0, softcap: float | None = 0.0,
            sinks: torch.Tensor | None = None) -> torch.Tensor | None:
        q, k, v = packed(q), packed(k), packed(v)
        if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
            return None
        if k.stride(0) != v.stride(0):  # one stride for both (views of one qkv tensor)
            k, v = k.contiguous(), v.contiguous()
        tokens, heads, d = q.shape
        out = torch.empty((tokens, heads * d), dtype=torch.bfloat16)
        status = fn(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0),
                    num_seqs, q_len, heads, k.shape[1], d, scale, out.data_ptr(), heads * d,
                    torch.get_num_threads(), window, softcap or 0.0,
                    sink_pointer(sinks, heads))
        return out if status == 0 else None

    return run


class NormActKernels:
    """Fused bfloat16 elementwise ops (:file:`csrc/norm_act.cpp`), same API as
    :class:`llmctl.serve.model.decoder.TorchNormAct`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norm = lib.add_rms_norm_bf16
        self._silu = lib.silu_mul_bf16
        self._gelu_tanh = lib.gelu_tanh_mul_bf16
        self._groups = lib.rms_norm_groups_bf16

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                     weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x += residual`` in place (when given), return ``RMSNorm(x) * weight``."""
        if residual is not None and not residual.is_contiguous():
            residual = residual.contiguous()
        out = torch.empty_like(x)
        self._norm(x.data_ptr(), residual.data_ptr() if residual is not None else None,
                   weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
                   torch.get_num_threads())
        return out

    def qk_norm(self, qk: torch.Tensor, weight: torch.Tensor, q_size: int, head_dim: int,
                per_head: bool, eps: float) -> torch.Tensor:
        """q and k of ``qk [T, q_size + kv_size]`` (rows may be strided apart) RMS-normed
        into a new contiguous tensor: per head with ``weight [heads + kv_heads, head_dim]``
        (Qwen3, Gemma 3), or over each whole projection with ``weight [q_size + kv_size]``
        (OLMo 2); add_rms_norm's roundings, ``bf16(w * bf16(x * inv))``."""
        if qk.stride(1) != 1:
            qk = qk.contiguous()
        if not weight.is_contiguous():
            weight = weight.contiguous()
        rows, width = qk.shape
        out = torch.empty((rows, width), dtype=qk.dtype, device=qk.device)
        threads, ld, w = torch.get_num_threads(), qk.stride(0), weight.data_ptr()
        if per_head:
            self._groups(qk.data_ptr(), ld, out.data_ptr(), width, rows, width // head_dim,
                         head_dim, w, head_dim, eps, threads)
            return out
        k_size, k_at = width - q_size, 2 * q_size  # bytes to k: bf16 elements * 2
        self._groups(qk.data_ptr(), ld, out.data_ptr(), width, rows, 1, q_size, w, 0, eps,
                     threads)
        self._groups(qk.data_ptr() + k_at, ld, out.data_ptr() + k_at, width, rows, 1, k_size,
                     w + k_at, 0, eps, threads)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dim."""
        return self._gated(self._silu, gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu(gate, approximate="tanh") * up`` (GeGLU: Gemma's ``gelu_pytorch_tanh``)."""
        return self._gated(self._gelu_tanh, gate_up)

    def act_mul(self, name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The fused ``act(gate) * up`` for an HF activation name, or None where there
        is none (the caller computes it with torch)."""
        return {"silu": self.silu_mul, "swish": self.silu_mul,
                "gelu_pytorch_tanh": self.gelu_tanh_mul}.get(name)

    @staticmethod
    def _gated(fn, gate_up: torch.Tensor) -> torch.Tensor:
        if not gate_up.is_contiguous():
            gate_up = gate_up.contiguous()
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype, device=gate_up.device)
        fn(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
        return out


class RopeKV:
    """RoPE on q and k plus the K/V cache write in one native call (bfloat16), with one
    table of rotations: ``freqs [positions, rot / 2]`` complex, the first ``rot``
    dimensions of each head rotating as interleaved pairs (``rot`` < head_dim: partial
    rotary, the rest pass through; :func:`llmctl.models.layers.rope.rotate_pairs`). The
    table is this object's own: a model with two tables (Gemma 3's sliding layers) holds
    two, each passing its table on every call."""

    def __init__(self, lib: ctypes.CDLL, freqs: torch.Tensor) -> None:
        # by the cache's storage: bf16, int8 codes (scales written), E4M3 codes (read)
        self._fns = {torch.bfloat16: lib.rope_kv_bf16, torch.int8: lib.rope_kv_bf16_i8,
                     torch.uint8: lib.rope_kv_bf16_f8}
        self.freqs = torch.view_as_real(freqs).contiguous()  # [positions, rot / 2, 2] float32
        self.rot = 2 * freqs.shape[-1]  # the rotated dimensions of a head

    def __call__(self, qk: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor, layer_cache: torch.Tensor,
                 layer_scales: torch.Tensor | None = None) -> None:
        """Rotate ``qk [T, q_heads + kv_heads, d]`` in place (rows may be strided, each
        row's heads contiguous) and write its keys and ``v [T, kv_heads, d]`` at
        ``slots`` of ``layer_cache [2, blocks, block_size, kv_heads, d]`` (an int8 cache:
        quantized, scales into ``layer_scales [2, blocks, block_size, kv_heads]``; an fp8
        cache: quantized with the static ``layer_scales [2, kv_heads]``)."""
        t, heads, d = qk.shape
        if self.rot > d:
            raise ValueError(f"a RoPE table of {self.rot} rotated dimensions for heads of {d}")
        kv_heads = v.shape[1]
        cache = (layer_cache[0].data_ptr(), layer_cache[1].data_ptr())
        fn = self._fns[layer_cache.dtype]
        if layer_scales is not None:
            cache += (layer_scales[0].data_ptr(), layer_scales[1].data_ptr())
        fn(qk.data_ptr(), qk.stride(0), v.data_ptr(), v.stride(0), t, heads - kv_heads,
           kv_heads, d, self.rot, self.freqs.data_ptr(), positions.data_ptr(), slots.data_ptr(),
           *cache, torch.get_num_threads())


def rope_kv_kernel(device: torch.device, dtype: torch.dtype, freqs: torch.Tensor) -> RopeKV | None:
    """The fused RoPE + cache write for bfloat16 activations and cache on the CPU, or None."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return None
    lib = _library()
    return RopeKV(lib, freqs) if lib is not None else None


def norm_act_kernels(device: torch.device, dtype: torch.dtype) -> NormActKernels | None:
    """The fused kernels for bfloat16 activations on the CPU, or None (use torch)."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return None
    lib = _library()
    return NormActKernels(lib) if lib is not None else None


def lowbit_kernel() -> tuple[object, bool] | None:
    """``(lowbit_gemm, simd)``: the low-bit matrix product of :file:`csrc/lowbit_gemm.cpp`
    and whether its AVX512-BF16 path is compiled in for this CPU; None without a build."""
    lib = _library()
    if lib is None:
        return None
    return lib.lowbit_gemm, bool(lib.lowbit_simd())


def lowbit_vnni_kernel() -> tuple[object, int] | None:
    """``(lowbit_gemv_vnni, max_rows)`` of :file:`csrc/lowbit_vnni.cpp`, or None when
    there is no build or this CPU lacks AVX512-VNNI."""
    lib = _library()
    if lib is None or not lib.lowbit_vnni_rows():
        return None
    return lib.lowbit_gemv_vnni, int(lib.lowbit_vnni_rows())


def lowbit_avx2_kernel() -> tuple[object, int] | None:
    """``(lowbit_gemv_avx2, rows)`` of :file:`csrc/lowbit_avx2.cpp` (``rows``: the most
    it is tuned for; it takes any number), or None when there is no build or this
    variant lacks AVX2 + FMA."""
    lib = _library()
    if lib is None or not lib.lowbit_avx2_rows():
        return None
    return lib.lowbit_gemv_avx2, int(lib.lowbit_avx2_rows())


def gemm_bf16_kernel():
    """``gemm_bf16`` of :file:`csrc/gemm_bf16.cpp`, or None when there is no build or
    this CPU lacks AVX512-BF16."""
    lib = _library()
    if lib is None or not lib.gemm_bf16_available():
        return None
    return lib.gemm_bf16


def gemm_bf16_amx_rows() -> int:
    """The fewest rows :file:`csrc/gemm_bf16.cpp` runs on the AMX tile unit (a build
    with AMX-BF16 whose process the kernel granted the tile state), else 0."""
    lib = _library()
    return int(lib.gemm_bf16_amx_rows()) if lib is not None and lib.gemm_bf16_available() else 0


def gemm_bf16w_avx2_kernel():
    """``gemm_bf16w_avx2`` of :file:`csrc/gemv_bf16_avx2.cpp` (bf16 weights as torch holds
    them, widened to float32 in registers), or None when there is no build or this variant
    lacks AVX2 + FMA."""
    lib = _library()
    if lib is None or not lib.gemm_bf16w_avx2_available():
        return None
    return lib.gemm_bf16w_avx2


def decode_layer_kernel():
    """:file:`csrc/decode_layer.cpp`'s ``decode_layer_bf16``, or None without a build or
    without any small-batch matrix kernel it calls: AVX512-BF16 (``gemm_bf16``),
    AVX512-VNNI (``lowbit_gemv_vnni``), or AVX2 + FMA (``gemm_bf16w_avx2``,
    ``lowbit_gemv_avx2``). Which of them a model's layers use is
    :func:`llmctl.serve.layers.decode_layers.matrix`'s question."""
    lib = _library()
    if lib is None or not (lib.gemm_bf16_available() or lib.lowbit_vnni_rows()
                           or lib.gemm_bf16w_avx2_available() or lib.lowbit_avx2_rows()):
        return None
    return lib.decode_layer_bf16


def lora_kernel():
    """:file:`csrc/lora.cpp`'s ``lora_add_bf16``, or None without a build."""
    lib = _library()
    return None if lib is None else lib.lora_add_bf16
