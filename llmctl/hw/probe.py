"""Measure this CPU's peaks for the threads llmctl runs with (``llmctl hw probe``).

1. Memory: a ``torch.sum`` over a buffer at least 8x the last-level cache (so every
   pass streams from DRAM) gives the read bandwidth; ``copy_`` of its first half into
   its second half the copy bandwidth, counted as bytes read + written.
2. Matrix products per dtype, each through the paths llmctl itself can take, on shapes
   that are compute-bound: a warm ``torch.matmul`` of n x n x n (oneDNN/MKL), the
   oneDNN packed linear of :class:`llmctl.serve.layers.quant_linear.PackedLinear` (dense
   fp32/bf16 layers), and for bf16 llmctl's own AVX512-BF16 kernel
   (:file:`llmctl/serve/kernels/csrc/gemm_bf16.cpp`) on a weight that stays in L2; int8 through
   ``torch._int_mm`` when torch has it on the CPU. A dtype's peak is its fastest path.
3. Every quantity runs once untimed, then ``repeats`` timed runs; the peak is the best
   run, the notes keep best / median / worst (this VM's bandwidth moves by a third from
   minute to minute, so the spread matters), and the CPU time other processes used
   meanwhile (:mod:`llmctl.utils.cpu_load`): a disturbed probe says so in its source.

The record, the cache (and :func:`~llmctl.perf.probe_record.cached_peaks`, which never
measures) and the :class:`~llmctl.perf.peaks.Peaks` built from it live in
:mod:`llmctl.perf.probe_record` (no timing there), below :mod:`llmctl.serve`, whose
engine reads the cache; this module runs the engine's kernels, so it sits above it. ``benchmarks/gemm_roof.py`` takes its
roofs from :func:`read_bandwidth`, :func:`torch_matmul` and :func:`own_gemm_bf16`.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmctl.perf.peaks import Peaks
from llmctl.perf.probe_record import (
    Measurement,
    ProbeRecord,
    check_threads,
    current_key,
)
from llmctl.utils import dtypes
from llmctl.utils.cpu import (
    available_ram_bytes,
    cpu_flags,
    last_level_cache,
    ram_bytes,
)
from llmctl.utils.cpu_load import foreign_since, sample

log = logging.getLogger("llmctl.perf")

MiB = 1024 ** 2
LLC_MULTIPLE = 8  # the read buffer is at least this many times the last-level cache
# The own kernel's warm shape: SmolLM2's 576 x 576 o_proj (648 KB of bf16, inside a 1 MB
# L2) times 512 rows, ``calls`` times per timed run.
OWN_ROWS, OWN_IN, OWN_OUT = 512, 576, 576


class Unavailable(Exception):
    """A path this machine or torch build does not have; the message says why."""


@dataclass(frozen=True)
class ProbePlan:
    """Sizes and repeats of one probe."""

    buffer_bytes: int  # read: all of it; copy: its first half into its second
    matmul_n: int  # torch.matmul / packed linear: n x n x n
    own_calls: int  # own kernel: calls of OWN_ROWS x OWN_IN x OWN_OUT per timed run
    repeats: int
    notes: tuple[str, ...] = ()


# quick -> (smallest read buffer, matmul n, own calls, repeats). The full plan's buffer,
# matmul and repeats are benchmarks/gemm_roof.py's roofs; quick keeps the buffer out of
# cache (memory passes are cheap) and cuts the products, where the time goes.
PLANS = {False: (512 * MiB, 2048, 20, 7), True: (256 * MiB, 1024, 5, 3)}


def plan_for(quick: bool, llc: tuple[int, int] | None, available: int | None) -> ProbePlan:
    """The plan for a machine with last-level cache ``(level, bytes)`` and ``available``
    bytes of free memory (the buffer takes at most a quarter of it)."""
    smallest, n, own_calls, repeats = PLANS[quick]
    want = max(smallest, LLC_MULTIPLE * llc[1]) if llc else smallest
    buffer = want if available is None else min(want, available // 4)
    buffer -= buffer % (2 * MiB)  # two equal halves for the copy, whole pages
    notes = []
    if llc is None:
        notes.append(f"cache sizes unknown (no /sys): the {buffer // MiB} MiB read buffer may "
                     "partly fit a large cache")
    elif buffer < LLC_MULTIPLE * llc[1]:
        notes.append(f"read buffer only {buffer / llc[1]:.1f}x the L{llc[0]} (free memory is "
                     "short): the bandwidths may include cache hits")
    return ProbePlan(buffer, n, own_calls, repeats, tuple(notes))


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, ...]:
    """Seconds of ``repeats`` runs of ``fn`` after one untimed warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return tuple(times)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    return statistics.median(timed(fn, repeats))


def watched(run: Callable[[], Measurement]) -> Measurement:
    """``run()``'s measurement with the other processes' CPU use meanwhile."""
    start = sample()
    found = run()
    return dataclasses.replace(found, foreign_cores=foreign_since(start))


def _buffer(nbytes: int):
    import torch

    return torch.ones(nbytes // 2, dtype=torch.bfloat16)  # ones: every page touched now


def _llc_text(nbytes: int) -> str:
    llc = last_level_cache()
    return f" ({nbytes / llc[1]:.0f}x the {llc[1] // MiB} MiB L{llc[0]})" if llc else ""


def read_bandwidth(nbytes: int, repeats: int, buffer=None) -> Measurement:
    """``torch.sum`` over ``nbytes`` of bf16: bytes read per second."""
    big = _buffer(nbytes) if buffer is None else buffer
    nbytes = big.numel() * big.element_size()
    return Measurement("read", "torch.sum", f"over {nbytes // MiB} MiB of bf16{_llc_text(nbytes)}",
                       nbytes, timed(big.sum, repeats))


def copy_bandwidth(nbytes: int, repeats: int, buffer=None) -> Measurement:
    """``copy_`` of the first half of ``nbytes`` into the second: bytes read + written
    per second (2 x half per run; a write's cache-line fill, if the CPU does one, is
    not counted)."""
    big = _buffer(nbytes) if buffer is None else buffer
    half = big.numel() // 2
    src, dst = big[:half], big[half:2 * half]
    moved = 2 * half * big.element_size()
    return Measurement("copy", "Tensor.copy_",
                       f"of {moved // 2 // MiB} MiB of bf16 into another {moved // 2 // MiB} MiB, "
                       "counted as bytes read + written", moved,
                       timed(lambda: dst.copy_(src), repeats))


def torch_matmul(dtype: str, n: int, repeats: int) -> Measurement:
    """A warm ``torch.matmul`` of ``n x n x n`` in ``dtype`` ("fp32", "bf16")."""
    import torch

    torch_dtype = dtypes.torch_dtype(dtype)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(torch_dtype)
    b = torch.randn(n, n, generator=gen).to(torch_dtype)
    c = torch.empty(n, n, dtype=torch_dtype)
    return Measurement(dtype, "torch.matmul", f"{n} x {n} x {n}", 2 * n ** 3,
                       timed(lambda: torch.matmul(a, b, out=c), repeats))


def packed_linear(dtype: str, n: int, repeats: int) -> Measurement:
    """llmctl's dense layer on oneDNN (:class:`~llmctl.serve.layers.quant_linear.PackedLinear`):
    ``n`` rows through an ``n x n`` weight."""
    import torch

    from llmctl.serve.layers.quant_linear import (
        PackedLinear,
        onednn_bf16_supported,
        packing_available,
    )

    torch_dtype = dtypes.torch_dtype(dtype)
    if torch_dtype == torch.bfloat16 and not onednn_bf16_supported():
        raise Unavailable("oneDNN packs bf16 weights only on CPUs with AVX512-BW/VL/DQ or "
                          "AVX-NE-CONVERT; this one emulates bf16 (torch.matmul measures it)")
    if not packing_available(torch_dtype, torch.device("cpu")):
        raise Unavailable("oneDNN weight packing is off (LLMCTL_CPU_KERNELS=0) or missing "
                          "from this torch build")
    gen = torch.Generator().manual_seed(0)
    layer = PackedLinear(torch.randn(n, n, generator=gen).to(torch_dtype), None, gemm="onednn")
    x = torch.randn(n, n, generator=gen).to(torch_dtype)
    return Measurement(dtype, "oneDNN packed linear", f"{n} rows x {n} x {n}", 2 * n ** 3,
                       timed(lambda: layer(x), repeats))


def own_gemm_bf16(calls: int, repeats: int) -> Measurement:
    """llmctl's own bf16 kernel on a warm, L2-resident weight (OWN_* shape), ``calls``
    products per timed run."""
    import torch

    from llmctl.serve.layers.quant_linear import bf16_gemm_layer

    gen = torch.Generator().manual_seed(0)
    layer = bf16_gemm_layer(torch.randn(OWN_OUT, OWN_IN, generator=gen).bfloat16())
    if layer is None:
        raise Unavailable("llmctl's own bf16 kernel needs AVX512-BF16 and a C++ compiler "
                          "(and LLMCTL_CPU_KERNELS not 0)")
    x = torch.randn(OWN_ROWS, OWN_IN, generator=gen).bfloat16()

    def run() -> None:
        for _ in range(calls):
            layer(x)

    return Measurement("bf16", "own kernel",
                       f"{OWN_ROWS} rows x {OWN_IN} x {OWN_OUT} (weight in L2), {calls} calls",
                       calls * 2 * OWN_ROWS * OWN_IN * OWN_OUT, timed(run, repeats))


def int_mm(n: int, repeats: int) -> Measurement:
    """``torch._int_mm``: int8 x int8 -> int32, ``n x n x n``."""
    import torch

    if not hasattr(torch, "_int_mm"):
        raise Unavailable(f"torch {torch.__version__} has no torch._int_mm")
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (n, n), dtype=torch.int8, generator=gen)
    b = torch.randint(-128, 128, (n, n), dtype=torch.int8, generator=gen)
    try:
        torch._int_mm(a[:32, :32], b[:32, :32])
    except (RuntimeError, NotImplementedError) as exc:
        raise Unavailable(f"torch._int_mm does not run on this CPU ({exc})") from None
    return Measurement("int8", "torch._int_mm", f"{n} x {n} x {n}", 2 * n ** 3,
                       timed(lambda: torch._int_mm(a, b), repeats))


INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def _slow_n(n: int, native: bool) -> int:
    """A product's size: ``n`` where the CPU has the instructions; a quarter of it where
    torch falls back to a slow path (AVX2-only CPUs, 1 thread: bf16 emulated at ~0.85
    GFLOP/s and ``_int_mm`` without VNNI at ~1 GFLOP/s, so 1024^3 took 2-2.5 s a run and
    the quick probe 19 s). Those paths are compute-bound at any size, so the smaller
    product measures the same rate."""
    return n if native else max(64, n // 4)


def _bf16_n(n: int) -> int:
    from llmctl.utils.device import native_bf16

    return _slow_n(n, native_bf16() is not None)


def _int8_n(n: int) -> int:
    return _slow_n(n, any(flag in cpu_flags() for flag in INT8_DOT_FLAGS))


# Every matrix-product path, in the order they run: (dtype, path, measure under a plan).
PATHS: tuple[tuple[str, str, Callable[[ProbePlan], Measurement]], ...] = (
    ("fp32", "torch.matmul", lambda p: torch_matmul("fp32", p.matmul_n, p.repeats)),
    ("fp32", "oneDNN packed linear", lambda p: packed_linear("fp32", p.matmul_n, p.repeats)),
    ("bf16", "torch.matmul", lambda p: torch_matmul("bf16", _bf16_n(p.matmul_n), p.repeats)),
    ("bf16", "oneDNN packed linear", lambda p: packed_linear("bf16", p.matmul_n, p.repeats)),
    ("bf16", "own kernel", lambda p: own_gemm_bf16(p.own_calls, p.repeats)),
    ("int8", "torch._int_mm", lambda p: int_mm(_int8_n(p.matmul_n), p.repeats)),
)


def _memory(plan: ProbePlan) -> list[Measurement]:
    """Read, then copy, on one buffer (freed on return)."""
    buffer = _buffer(plan.buffer_bytes)
    return [watched(lambda: read_bandwidth(plan.buffer_bytes, plan.repeats, buffer)),
            watched(lambda: copy_bandwidth(plan.buffer_bytes, plan.repeats, buffer))]


def measure(threads: int | None = None, *, quick: bool = False) -> ProbeRecord:
    """Run the probe with ``threads`` torch threads (restored afterwards); ``quick``:
    smaller products and fewer runs (on a 2-core Zen 4: 0.4 s instead of 3 s, plus a
    one-time build of llmctl's kernels)."""
    import torch

    key = current_key(check_threads(threads) if threads is not None else None)
    plan = plan_for(quick, last_level_cache(), available_ram_bytes())
    before = torch.get_num_threads()
    torch.set_num_threads(key.threads)
    start = time.perf_counter()
    notes = list(plan.notes)
    try:
        found = _memory(plan)
        for dtype, path, run in PATHS:
            try:
                found.append(watched(lambda run=run: run(plan)))
            except Unavailable as exc:
                notes.append(f"{dtype}: {path} not measured: {exc}")
    finally:
        torch.set_num_threads(before)
    if not any(m.kind == "int8" for m in found):
        notes.append("int8: no peak (no usable int8 matrix product in this torch)")
    notes.append(f"probe took {time.perf_counter() - start:.1f} s"
                 + (" (--quick: smaller products, fewer runs)" if quick else ""))
    return ProbeRecord(key, _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                       tuple(found), ram_bytes(), quick, tuple(notes))


def probe(threads: int | None = None, *, quick: bool = False) -> Peaks:
    """Measure this machine's peaks with ``threads`` (default: torch's current thread
    count). Does not cache: ``llmctl hw probe`` (or :func:`probe_record.save`) does."""
    return measure(threads, quick=quick).peaks()
