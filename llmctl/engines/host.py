"""What this machine offers an engine: CPU architecture and ISA flags, GPU, runtimes.

A built engine records the same facts about the machine it was built on (see
:mod:`llmctl.engines.manifest`), and its requirements are checked against a fresh probe
before loading. Nothing here imports torch or onnxruntime unless asked for the fact
that needs it.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

from llmctl.utils.cpu import cpu_flags, cpu_model


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def nvidia_gpus() -> list[str]:
    """GPU names from ``nvidia-smi`` (no CUDA library needed); empty without one."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def ort_providers() -> list[str]:
    """Execution providers this onnxruntime build offers (not proof that they run)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return []
    return list(ort.get_available_providers())


@dataclass(frozen=True)
class Host:
    arch: str
    cpu: str
    cores: int
    flags: frozenset[str]
    gpus: tuple[str, ...]
    packages: dict[str, str | None] = field(hash=False)

    @classmethod
    def probe(cls) -> Host:
        names = ("torch", "onnxruntime", "onnxruntime-gpu", "onnxruntime-genai", "onnx",
                 "tensorrt_llm", "tensorrt-llm", "transformers")
        return cls(arch=platform.machine(), cpu=cpu_model(), cores=os.cpu_count() or 1,
                   flags=cpu_flags(), gpus=tuple(nvidia_gpus()),
                   packages={n: package_version(n) for n in names})

    def describe(self, isa_flags: tuple[str, ...] = ()) -> dict:
        """The record kept in a manifest: only the ISA flags that matter to builds."""
        shown = sorted(f for f in self.flags if f in set(isa_flags) | set(WATCHED_FLAGS))
        return {"arch": self.arch, "cpu": self.cpu, "cores": self.cores, "isa_flags": shown,
                "gpus": list(self.gpus),
                "packages": {k: v for k, v in self.packages.items() if v is not None}}


# x86 flags worth recording about a build machine (what compilers and kernels key on).
WATCHED_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw",
                 "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
                 "amx_bf16", "amx_int8", "asimd", "sve")
