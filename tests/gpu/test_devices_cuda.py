"""What ``plan``, ``bench`` and the engine's MFU/MBU read from a real GPU: its name
matched against the datasheet table (llmctl.perf.devices), the peaks that row gives,
and the memory the card reports against the row's marketed size."""

from __future__ import annotations

import pytest
import torch

from llmctl.perf import devices
from llmctl.perf.hardware import resolve_peaks
from tests.gpu.common import GPU, REAL_CUDA, record

pytestmark = [*GPU, REAL_CUDA]


def test_the_gpu_name_finds_its_table_row():
    name = torch.cuda.get_device_name(0)
    row = devices.match_device_name(name)
    total = torch.cuda.get_device_properties(0).total_memory
    record("devices", name=name, row=row.key if row else None, total_memory=total,
           capability=list(torch.cuda.get_device_capability(0)))
    if not any(k in name for k in ("H100", "H200", "A100", "L4", "L40S", "A10G")):
        pytest.skip(f"{name!r} is not a GPU the table lists")
    assert row is not None, f"{name!r} matched no row of llmctl.perf.devices.DEVICES"
    # the marketed size (GB or GiB) against what the driver reports: within 12%
    assert total == pytest.approx(row.memory_gib * devices.GIB, rel=0.12)
    peaks = devices.detect_gpu_peaks()
    assert peaks is not None and peaks.source.startswith(f"table: {row.key}")
    assert peaks.flops_for("bf16") == row.flops["bf16"]


def test_automatic_hardware_is_the_gpu_not_the_cpu_probe():
    """resolve_peaks(None) (bench, the engine's utilization) takes the GPU's row first."""
    row = devices.match_device_name(torch.cuda.get_device_name(0))
    if row is None:
        pytest.skip("this GPU is not in the table: resolve_peaks falls back to the CPU probe")
    peaks = resolve_peaks(None)
    assert peaks.source == row.peaks().source
    assert peaks.bandwidth == row.bandwidth


def test_the_run_report_names_the_gpu():
    from llmctl.report import machine

    info = machine()
    assert info["gpu"] == torch.cuda.get_device_name(0)
