"""Read a float safetensors checkpoint one tensor at a time, memory-mapped.

Shapes and dtypes come from the file headers without loading anything, so planning a
run over a model larger than RAM costs nothing; tensors are read on demand and the
file handles are closed between layers so mapped pages can be dropped.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from llmctl.errors import ConfigError, NotAModelError
from llmctl.utils.dtypes import SAFETENSORS, torch_dtype


def _header(path: Path) -> dict:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length))


class Checkpoint:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise NotAModelError(f"{self.path} has no config.json", "pass a model directory")
        self.config: dict = json.loads(config_file.read_text())
        if self.config.get("quantization_config"):
            raise ConfigError(f"{self.path} is already quantized "
                              f"({self.config['quantization_config'].get('quant_method', '?')})",
                              "quantize the original float checkpoint")
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise NotAModelError(f"{self.path} has no .safetensors weights",
                                 "convert the checkpoint to safetensors (save_pretrained does)")
        self.file_of: dict[str, Path] = {}
        self.meta: dict[str, dict] = {}
        for file in files:
            for name, entry in _header(file).items():
                if name != "__metadata__":
                    self.file_of[name] = file
                    self.meta[name] = entry
        self._handles: dict[Path, object] = {}

    @property
    def text_config(self) -> dict:
        return self.config.get("text_config", self.config)

    def names(self) -> list[str]:
        return list(self.file_of)

    def has(self, name: str) -> bool:
        return name in self.file_of

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.meta[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return torch_dtype(SAFETENSORS[self.meta[name]["dtype"]].name)

    def nbytes(self, name: str) -> int:
        start, end = self.meta[name]["data_offsets"]
        return end - start

    def get(self, name: str, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        from safetensors import safe_open

        file = self.file_of[name]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(str(file), framework="pt")
        tensor = handle.get_tensor(name)
        # Always a private copy: nothing may keep the file mapping (and its resident
        # pages) alive once the layer is done.
        return tensor.to(dtype=dtype or tensor.dtype, device=device, copy=True)

    def close(self) -> None:
        self._handles.clear()

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype most parameters are stored in (scales and copies use it too)."""
        counts: dict[torch.dtype, int] = {}
        for name in self.file_of:
            dt = self.dtype(name)
            if dt.is_floating_point:
                counts[dt] = counts.get(dt, 0) + self.nbytes(name)
        return max(counts, key=counts.get) if counts else torch.float32
