"""Read a float safetensors checkpoint one tensor at a time, memory-mapped.

Shapes and dtypes come from the file headers without loading anything, so planning a
run over a model larger than RAM costs nothing; tensors are read on demand and the
file handles are closed between layers so mapped pages can be dropped.

gpt-oss's fused experts (float or MXFP4) are answered as per-expert linears by their
own names (:mod:`llmctl.quant.fused_experts`), the fused tensors hidden: the quantizer
handles it as any per-expert mixture. Its ``quantization_config: mxfp4`` describes the
experts only, which are decoded on read, so such a checkpoint is read as a float one.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from llmctl.errors import ConfigError, NotAModelError
from llmctl.quant import fused_experts
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
        fused_layout = fused_experts.layout_of(self.config)
        quant = self.config.get("quantization_config") or {}
        if fused_layout is not None and quant.get("quant_method") == "mxfp4":
            self.config.pop("quantization_config")  # the experts, decoded on read
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
        self.views: dict[str, fused_experts.ExpertView] = {}
        self._hidden: set[str] = set()
        if fused_layout is not None:
            self.views, self._hidden = fused_experts.expert_views(
                self.meta, self._stored_dtype, fused_layout)
        self._decoded: dict[str, torch.Tensor] = {}  # fused weights being read
        self._pending: dict[str, int] = {}  # their views not read yet
        self._weight_views: dict[str, int] = {}
        for view in self.views.values():
            if not view.bias:
                self._weight_views[view.fused] = self._weight_views.get(view.fused, 0) + 1

    @property
    def text_config(self) -> dict:
        return self.config.get("text_config", self.config)

    def names(self) -> list[str]:
        """Every tensor, gpt-oss's fused experts by their per-expert names."""
        return [n for n in self.file_of if n not in self._hidden] + list(self.views)

    def has(self, name: str) -> bool:
        return name in self.views or (name in self.file_of and name not in self._hidden)

    def shape(self, name: str) -> tuple[int, ...]:
        view = self.views.get(name)
        return view.shape if view is not None else tuple(self.meta[name]["shape"])

    def _stored_dtype(self, name: str) -> torch.dtype:
        return torch_dtype(SAFETENSORS[self.meta[name]["dtype"]].name)

    def dtype(self, name: str) -> torch.dtype:
        view = self.views.get(name)
        return view.dtype if view is not None else self._stored_dtype(name)

    def nbytes(self, name: str) -> int:
        view = self.views.get(name)
        if view is not None:
            n = 1
            for d in view.shape:
                n *= d
            return n * torch.empty(0, dtype=view.dtype).element_size()
        start, end = self.meta[name]["data_offsets"]
        return end - start

    def get(self, name: str, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        view = self.views.get(name)
        if view is None:
            return self._read(name, dtype, device)
        if view.bias:
            tensor = fused_experts.read(view, None, self._read(f"{view.fused}_bias"))
            return tensor.to(dtype=dtype or view.dtype, device=device, copy=True)
        # the fused weight decoded once for all its experts' views, dropped when the last
        # of them is read (a layer's experts are read together) or at close()
        fused = self._decoded.get(view.fused)
        if fused is None:
            fused = self._decoded[view.fused] = fused_experts.decode(
                self._read, lambda n: n in self.file_of, view.fused, view.dtype)
            self._pending[view.fused] = self._weight_views[view.fused]
        self._pending[view.fused] -= 1
        if self._pending[view.fused] == 0:
            del self._decoded[view.fused]
        tensor = fused_experts.read(view, fused, None)
        return tensor.to(dtype=dtype or view.dtype, device=device, copy=True)

    def _read(self, name: str, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
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
        self._decoded.clear()

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype most parameters are stored in (scales and copies use it too)."""
        counts: dict[torch.dtype, int] = {}
        for name in self.names():
            dt = self.dtype(name)
            if dt.is_floating_point:
                counts[dt] = counts.get(dt, 0) + self.nbytes(name)
        return max(counts, key=counts.get) if counts else torch.float32
