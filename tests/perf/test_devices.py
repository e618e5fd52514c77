"""The datasheet table against the datasheets (dense = half the "with sparsity" figures)."""

import sys
import types

import pytest

from llmctl.errors import UsageError
from llmctl.perf.devices import (
    DEVICES,
    detect_gpu_peaks,
    device_peaks,
    known_devices,
    match_device_name,
)


@pytest.mark.parametrize("name,dtype,tflops,tb_s,gib", [
    # H100 SXM datasheet: BF16 1,979 TFLOPS*, FP8 3,958*, * with sparsity; 3.35 TB/s; 80 GB
    ("h100-80gb", "bf16", 1979 / 2, 3.35, 80),
    ("h100-80gb", "fp8", 3958 / 2, 3.35, 80),
    # H100 PCIe: BF16 1,513*, 2 TB/s
    ("h100-pcie", "bf16", 1513 / 2, 2.0, 80),
    # H200: the H100's compute, 141 GB at 4.8 TB/s
    ("h200", "bf16", 1979 / 2, 4.8, 141),
    # A100 datasheet: BF16 312 (624*), INT8 624 TOPS (1248*); 1,555 / 2,039 GB/s
    ("a100-40gb", "bf16", 312, 1.555, 40),
    ("a100-80gb", "int8", 1248 / 2, 2.039, 80),
    # L4: FP8 485*, 300 GB/s; L40S: BF16 362.05 (733*), 864 GB/s
    ("l4", "fp8", 485 / 2, 0.3, 24),
    ("l40s", "bf16", 362.05, 0.864, 48),
    # MI300X: FP16 1307.4 dense, FP8 2614.9; 5.3 TB/s, 192 GB
    ("mi300x", "fp8", 2614.9, 5.3, 192),
])
def test_entries_match_the_datasheets(name, dtype, tflops, tb_s, gib):
    peaks = device_peaks(name)
    assert peaks.flops[dtype] == pytest.approx(tflops * 1e12, rel=0.002)
    assert peaks.bandwidth == pytest.approx(tb_s * 1e12)
    assert peaks.memory_bytes == gib * 2**30
    assert peaks.source.startswith(f"table: {name} (https://")


def test_every_entry_has_a_source_and_no_sparse_figures():
    for d in DEVICES:
        assert d.source.startswith("https://")
        # dense bf16 never above fp8/int8 (a sparse figure slipped in would break this)
        assert all(d.flops["bf16"] <= d.flops[k] for k in ("fp8", "int8") if k in d.flops)
    assert "fp8" not in device_peaks("a100-80gb").flops  # Ampere has no FP8 units


def test_alias_and_unknown_name():
    assert device_peaks("h100-sxm") == device_peaks("h100-80gb")
    assert device_peaks("H100-SXM") == device_peaks("h100-80gb")
    with pytest.raises(UsageError, match="unknown hardware 'h101'") as err:
        device_peaks("h101")
    assert "h100-80gb" in err.value.remedy and "mi300x" in err.value.remedy
    assert "h100-sxm" in known_devices()


@pytest.mark.parametrize("gpu,key", [
    ("NVIDIA H100 80GB HBM3", "h100-80gb"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA L40S", "l40s"),
    ("AMD Instinct MI300X", "mi300x"),
    # variants with other clocks or memory borrow no sibling's row
    ("NVIDIA H100 NVL", None),
    ("NVIDIA A100 80GB PCIe", None),
    ("NVIDIA H200 NVL", None),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_device_names_match_exactly(gpu, key):
    found = match_device_name(gpu)
    assert (found.key if found else None) == key


def fake_torch(monkeypatch, available: bool, name: str = "") -> None:
    cuda = types.SimpleNamespace(is_available=lambda: available,
                                 get_device_name=lambda i=0: name)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))


def test_detect_gpu_peaks(monkeypatch):
    fake_torch(monkeypatch, True, "NVIDIA L4")
    assert detect_gpu_peaks() == device_peaks("l4")
    fake_torch(monkeypatch, True, "NVIDIA GeForce RTX 4090")
    assert detect_gpu_peaks() is None  # unknown: never a guess
    fake_torch(monkeypatch, False)
    assert detect_gpu_peaks() is None
