"""The kernels' C sources on their own (tests/serve/kernels/csrc_check/kernel_check.cpp against a
naive double-precision reference): built natively, and cross-compiled for aarch64 and run
under qemu-user, so the NEON bodies (paged attention, the bf16 norm and activation) and
the portable ones are known to build and compute right on ARM. Speed on ARM is not
measured anywhere.

`make test` installs Debian's g++-aarch64-linux-gnu and qemu-user where it can (as root);
without them the aarch64 test skips and says which packages it needs."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from llmctl.serve.kernels import cpu as cpu_kernels

CSRC = Path(cpu_kernels.__file__).parent / "csrc"
DRIVER = Path(__file__).parent / "csrc_check" / "kernel_check.cpp"
UNITS = [CSRC / "paged_attention.cpp", CSRC / "norm_act.cpp"]
CROSS_CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
SYSROOT = Path("/usr/aarch64-linux-gnu")
# The ARM targets the kernels support: plain ARMv8-A (NEON is part of every AArch64 core;
# the bodies need nothing more) and ARMv8.2-A with the bf16 extension (Neoverse V1/N2,
# Graviton 3), which must build and compute the same.
AARCH64_MARCHES = ("armv8-a", "armv8.2-a+bf16")
# kernel_check.cpp prints these for an ARM build's vector bodies
NEON_BODIES = ("paged_attention_simd: neon", "norm_act_simd: neon")


def _build(cxx: str, flags: tuple[str, ...], out: Path) -> None:
    """The driver and every unit, compiled side by side as the engine's own build does."""
    cpu_kernels.compile_units(cxx, ["-fopenmp", "-std=c++17", *flags, f"-I{CSRC}"],
                              [DRIVER, *UNITS], str(out))


def _check(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "\nok: " in "\n" + proc.stdout, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.skipif(cpu_kernels._compiler() is None, reason="no C++ compiler")
def test_kernels_match_the_naive_reference_natively(tmp_path):
    """The driver's reference agrees with the kernels here (each variant is compared with
    torch in test_cpu_kernels.py), so a failure under qemu is the port's."""
    exe = tmp_path / "kernel_check"
    _build(cpu_kernels._compiler(), ("-O2", "-march=native"), exe)
    _check([str(exe)])


WRONG_SCALE = r"""
#include <cstdint>
extern "C" void real_paged_attention_f32(const float*, const float*, const float*,
    const int64_t*, int64_t, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
    int64_t, int64_t, float, float*, int, int64_t, float, const float*);
extern "C" void paged_attention_f32(const float* q, const float* k, const float* v,
    const int64_t* bt, int64_t mb, const int64_t* ctx, int64_t ns, int64_t ql, int64_t qs,
    int64_t h, int64_t kvh, int64_t d, int64_t bs, float scale, float* out, int t, int64_t w,
    float cap, const float* sinks) {
  real_paged_attention_f32(q, k, v, bt, mb, ctx, ns, ql, qs, h, kvh, d, bs, 1.01f * scale,
                           out, t, w, cap, sinks);
}
"""


@pytest.mark.skipif(cpu_kernels._compiler() is None, reason="no C++ compiler")
def test_the_driver_catches_a_wrong_kernel(tmp_path):
    """The check can fail: a paged attention whose softmax scale is 1 % off is caught."""
    cxx = cpu_kernels._compiler()
    wrapper = tmp_path / "wrong_scale.cpp"
    wrapper.write_text(WRONG_SCALE)
    renamed = tmp_path / "paged_attention.o"
    proc = subprocess.run([cxx, "-O1", "-fopenmp", "-std=c++17", "-c",
                           "-Dpaged_attention_f32=real_paged_attention_f32", "-o", str(renamed),
                           str(CSRC / "paged_attention.cpp")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    exe = tmp_path / "kernel_check"
    proc = subprocess.run([cxx, "-O1", "-fopenmp", "-std=c++17", "-o", str(exe), str(DRIVER),
                           str(wrapper), str(renamed), str(CSRC / "norm_act.cpp")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 1 and "mismatch in paged_attention_f32" in run.stdout


@pytest.mark.skipif(shutil.which(CROSS_CXX) is None,
                    reason=f"no {CROSS_CXX} (Debian package g++-aarch64-linux-gnu)")
def test_every_kernel_source_compiles_for_aarch64():
    for unit in sorted(CSRC.glob("*.cpp")):
        proc = subprocess.run([CROSS_CXX, "-O2", "-fopenmp", "-std=c++17", "-fsyntax-only",
                               str(unit)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{unit.name}: {proc.stderr[-2000:]}"


needs_qemu = pytest.mark.skipif(
    shutil.which(CROSS_CXX) is None or shutil.which(QEMU) is None or not SYSROOT.is_dir(),
    reason=f"needs {CROSS_CXX} and {QEMU} (Debian packages g++-aarch64-linux-gnu and qemu-user)")


@needs_qemu
@pytest.mark.parametrize("march", AARCH64_MARCHES)
def test_neon_kernels_compute_right_on_aarch64_under_qemu(tmp_path, march):
    """Built as cpu_kernels builds them (-O3 -fno-math-errno), for each ARM target: the
    check passes and reports the NEON bodies, so a build whose #if lost them (and fell
    back to the portable loops, which pass the same check) fails here."""
    exe = tmp_path / "kernel_check-aarch64"
    _build(CROSS_CXX, ("-O3", "-fno-math-errno", f"-march={march}"), exe)
    out = _check([QEMU, "-L", str(SYSROOT), str(exe)])
    for body in NEON_BODIES:
        assert body in out.splitlines(), out


@needs_qemu
def test_portable_kernels_compute_right_on_aarch64_under_qemu(tmp_path):
    """The portable loops on ARM (what a 32-bit or NEON-less build gets): -U__ARM_NEON
    hides the NEON bodies, and the check says none was built."""
    exe = tmp_path / "kernel_check-aarch64-portable"
    _build(CROSS_CXX, ("-O3", "-fno-math-errno", "-march=armv8-a", "-U__ARM_NEON"), exe)
    out = _check([QEMU, "-L", str(SYSROOT), str(exe)])
    assert not any(body in out for body in NEON_BODIES), out


@pytest.mark.skipif(cpu_kernels._compiler() is None or platform.machine() != "x86_64",
                    reason="needs an x86-64 host with a C++ compiler")
@pytest.mark.parametrize("variant", [v for v in cpu_kernels.X86_VARIANTS
                                     if v not in cpu_kernels.supported_variants()])
def test_variants_this_cpu_cannot_run_still_compile(variant):
    """An AVX2-only machine cannot run the AVX-512 bodies, but it can compile them: a
    change that breaks them fails here, not only on an AVX-512 machine."""
    flags = cpu_kernels.VARIANTS[variant][0]
    for unit in sorted(CSRC.glob("*.cpp")):
        proc = subprocess.run([cpu_kernels._compiler(), "-fopenmp", "-std=c++17", *flags,
                               "-fsyntax-only", str(unit)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{variant} {unit.name}: {proc.stderr[-2000:]}"
