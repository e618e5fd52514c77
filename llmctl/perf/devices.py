"""GPU datasheet peaks: a table, one row per device, each with the page it came from.

Matrix-product peaks are dense (the datasheets' headline "with sparsity" figures are
twice these: 2:4 structured sparsity, which LLM serving does not use), in FLOP/s (int8 in
OP/s); ``fp32`` is the non-tensor-core rate (what a float32 matmul runs at without TF32).
Bandwidth is the memory's peak in bytes/s (decimal: 3.35 TB/s = 3.35e12 B/s); memory is
the marketed size in GiB (an "80GB" H100 shows 81559 MiB in nvidia-smi, the A100 80GB
81920 MiB). Attainable rates are lower: :mod:`llmctl.perf.plan` says what it assumes.

:func:`detect_gpu_peaks` matches ``torch.cuda.get_device_name()`` against each row's
``names`` (full match, case-insensitive) and returns None for anything else: a variant
with other clocks or memory (H100 NVL, A100 PCIe, H200 NVL) must not borrow a sibling's row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmctl.errors import UsageError
from llmctl.perf.peaks import Peaks

T = 1e12
GIB = 2**30


@dataclass(frozen=True)
class Device:
    key: str
    title: str
    flops: dict[str, float]  # dense peaks per dtype
    bandwidth: float  # bytes/s
    memory_gib: int
    source: str  # the vendor page the numbers come from
    names: tuple[str, ...]  # regexes for torch.cuda.get_device_name()
    aliases: tuple[str, ...] = ()
    note: str = ""

    def peaks(self) -> Peaks:
        notes = ("dense peaks (no 2:4 sparsity); datasheet maxima, not attained rates",
                 *((self.note,) if self.note else ()))
        return Peaks(dict(self.flops), self.bandwidth, f"table: {self.key} ({self.source})",
                     self.memory_gib * GIB, notes)


DEVICES: tuple[Device, ...] = (
    Device("h100-80gb", "NVIDIA H100 SXM5 80GB",
           {"fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T,
            "fp8": 1978.9 * T, "int8": 1978.9 * T},
           3.35e12, 80, "https://www.nvidia.com/en-us/data-center/h100/",
           (r"NVIDIA H100 80GB HBM3", r"NVIDIA H100 SXM5? 80GB"), aliases=("h100-sxm",)),
    Device("h100-pcie", "NVIDIA H100 PCIe 80GB",
           {"fp32": 51 * T, "tf32": 378 * T, "bf16": 756 * T, "fp16": 756 * T,
            "fp8": 1513 * T, "int8": 1513 * T},
           2.0e12, 80, "https://www.nvidia.com/en-us/data-center/h100/",
           (r"NVIDIA H100 PCIe",)),
    Device("h200", "NVIDIA H200 SXM 141GB",
           {"fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T,
            "fp8": 1978.9 * T, "int8": 1978.9 * T},
           4.8e12, 141, "https://www.nvidia.com/en-us/data-center/h200/",
           (r"NVIDIA H200",), aliases=("h200-sxm",),
           note="memory is 141 GB as marketed (HBM3e), listed as 141 GiB"),
    Device("a100-40gb", "NVIDIA A100 SXM4 40GB",
           {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T,
            "int8": 624 * T},
           1.555e12, 40,
           "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
           "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
           (r"NVIDIA A100-SXM4-40GB",), aliases=("a100-sxm-40gb",)),
    Device("a100-80gb", "NVIDIA A100 SXM4 80GB",
           {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T,
            "int8": 624 * T},
           2.039e12, 80,
           "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
           "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
           (r"NVIDIA A100-SXM4-80GB",), aliases=("a100-sxm", "a100")),
    Device("l4", "NVIDIA L4 24GB",
           {"fp32": 30.3 * T, "tf32": 60 * T, "bf16": 121 * T, "fp16": 121 * T,
            "fp8": 242.5 * T, "int8": 242.5 * T},
           300e9, 24, "https://www.nvidia.com/en-us/data-center/l4/", (r"NVIDIA L4",)),
    Device("l40s", "NVIDIA L40S 48GB",
           {"fp32": 91.6 * T, "tf32": 183 * T, "bf16": 362.05 * T, "fp16": 362.05 * T,
            "fp8": 733 * T, "int8": 733 * T},
           864e9, 48, "https://www.nvidia.com/en-us/data-center/l40s/", (r"NVIDIA L40S",)),
    Device("a10g", "NVIDIA A10G 24GB (AWS G5)",
           {"tf32": 35 * T, "bf16": 70 * T, "fp16": 70 * T, "int8": 140 * T},
           600e9, 24, "https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/",
           (r"NVIDIA A10G",),
           note="NVIDIA publishes no A10G datasheet: tensor peaks as Baseten compiled them, "
                "not checked against an NVIDIA document (the A10's datasheet lists 125 dense "
                "BF16 TFLOPS; the A10G has fewer tensor cores' worth)"),
    Device("mi300x", "AMD Instinct MI300X 192GB",
           {"fp32": 163.4 * T, "tf32": 653.7 * T, "bf16": 1307.4 * T, "fp16": 1307.4 * T,
            "fp8": 2614.9 * T, "int8": 2614.9 * T},
           5.3e12, 192,
           "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html",
           (r"AMD Instinct MI300X( OAM)?",)),
)

_BY_NAME: dict[str, Device] = {name: d for d in DEVICES for name in (d.key, *d.aliases)}


def known_devices() -> list[str]:
    """Every key and alias :func:`device_peaks` accepts."""
    return sorted(_BY_NAME)


def device(name: str) -> Device:
    try:
        return _BY_NAME[name.strip().lower()]
    except KeyError:
        raise UsageError(f"unknown hardware {name!r}",
                         "known: " + ", ".join(d.key for d in DEVICES)
                         + " (aliases: " + ", ".join(a for d in DEVICES for a in d.aliases)
                         + "), or 'this'") from None


def device_peaks(name: str) -> Peaks:
    """The tabled peaks of ``name`` (a key or an alias); an unknown name is an error that
    lists the known ones."""
    return device(name).peaks()


def match_device_name(gpu_name: str) -> Device | None:
    """The row whose ``names`` fully match ``gpu_name``; None when no row does."""
    for d in DEVICES:
        if any(re.fullmatch(pattern, gpu_name.strip(), re.IGNORECASE) for pattern in d.names):
            return d
    return None


def detect_gpu_peaks() -> Peaks | None:
    """The peaks of GPU 0 when torch sees one listed here; None on CPU, without torch,
    or for an unlisted GPU (never a guess)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    found = match_device_name(torch.cuda.get_device_name(0))
    return found.peaks() if found else None
