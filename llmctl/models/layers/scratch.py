"""Buffers a forward takes again at every step instead of allocating them.

glibc serves a block above its mmap threshold (at most 32 MiB in its dynamic mode) with a
mapping of its own and unmaps it when freed, so each such allocation faults all of its
pages in again: for 64 MiB, 16k faults, ~20-30 ms on the development machine, more than
the copy that fills it. A mixture of experts' grouped computation holds ``[tokens x top-k,
hidden]`` rows four times per layer (2048 tokens of a Qwen3-MoE shape: 64 MiB each in
bf16); taken from here, they are faulted in once for the engine's life. Raising glibc's
thresholds instead was measured and refused: a freed block that small long-lived objects
allocated after it pin is not reused for the next block of the same size (posix_memalign
asks for a little more), and resident memory grew 64 MiB per step.
"""

from __future__ import annotations

import torch


class Scratch:
    """Named buffers that grow to the largest request and are handed out as views. One
    forward at a time (the engine's): a view is valid until the next ``take`` of its name."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """An uninitialised ``shape`` tensor backed by buffer ``name``."""
        numel = 1
        for size in shape:
            numel *= size
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
