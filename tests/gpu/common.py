"""What every ``gpu`` test shares: the marker, the skip, the device they run on.

The tests in this folder are collected everywhere and skipped with the reason where
``torch.cuda.is_available()`` is false. ``LLMCTL_GPU_TESTS_DEVICE=cpu`` runs them with the
CPU standing in for the GPU: nothing about CUDA is proven then, but the tests' own
plumbing (fixtures, API calls, comparisons) is, on a machine without a GPU; the few
tests that read the real device (its name, its FP8 matmul) still skip.
"""

from __future__ import annotations

import os

import pytest
import torch

STANDIN_ENV = "LLMCTL_GPU_TESTS_DEVICE"


def _standin() -> bool:
    return os.environ.get(STANDIN_ENV, "").strip().lower() == "cpu"


def _reason() -> str:
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
    return (f"needs a CUDA device: torch.cuda.is_available() is false (torch "
            f"{torch.__version__}, {build}); scripts/device-check runs these on a GPU")


HAS_CUDA = torch.cuda.is_available()
# Every module here sets ``pytestmark = GPU``.
GPU = [pytest.mark.gpu, pytest.mark.skipif(not (HAS_CUDA or _standin()), reason=_reason())]
# For the tests that read the real device and mean nothing on a stand-in.
REAL_CUDA = pytest.mark.skipif(not HAS_CUDA, reason=_reason())


def gpu_device() -> torch.device:
    """The device the tests compare against the CPU: CUDA, or the CPU as a stand-in."""
    return torch.device("cuda") if HAS_CUDA else torch.device("cpu")


def device_name() -> str:
    """``cuda`` or ``cpu``, as llmctl's options spell a device."""
    return gpu_device().type


RECORD_ENV = "LLMCTL_GPU_RECORD"


def record(test: str, **values) -> None:
    """Append what a comparison measured (agreement, gaps) to the JSON-lines file named by
    ``LLMCTL_GPU_RECORD``, so scripts/device-check's report shows the numbers behind each
    tolerance, passed or not; a no-op without the variable."""
    import json

    path = os.environ.get(RECORD_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **values}, default=float) + "\n")
