"""Write a compressed-tensors checkpoint: the tensors of each format, the config, the rest.

Tensor names per quantized linear ``P`` (what compressed-tensors' compressors produce,
and what transformers and vLLM load):

- ``pack-quantized`` (int weights, no/int activations of 16 bits): ``P.weight_packed``
  (int32, codes packed along the input dim, see ``packing``), ``P.weight_scale``,
  ``P.weight_shape`` (int64 [rows, cols]) and, when asymmetric per group/channel,
  ``P.weight_zero_point`` packed along the *output* dim;
- ``int-quantized`` (int8 weights with int8 activations), ``float-quantized`` (FP8 weights
  with FP8 activations), ``naive-quantized`` (FP8 weight-only): ``P.weight`` holds the
  codes (int8 / float8_e4m3fn), with ``P.weight_scale`` (and ``P.weight_zero_point``);
- static activations add ``P.input_scale`` (and ``P.input_zero_point``).

Scales are stored in the weight's own float dtype. Shards are laid out before the run
(see :class:`PlannedWriter`) and tensors are written to them as each layer finishes.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from llmctl.quant.packing import pack_int32
from llmctl.quant.plan import ModulePlan, QuantPlan
from llmctl.utils.dtypes import DTYPES, dtype_name

SKIP_SIDE_FILES = ("config.json", "llmctl-manifest.json", "llmctl-quant.json", "recipe.yaml",
                   "model.safetensors.index.json")
SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


@dataclass
class QuantizedLinear:
    codes: torch.Tensor  # int8 codes or float8_e4m3fn values, (rows, cols)
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    input_zero: torch.Tensor | None = None


def module_tensors(plan: ModulePlan, q: QuantizedLinear, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one quantized linear (without its bias)."""
    w = plan.weight
    out: dict[str, torch.Tensor] = {}
    p = plan.name
    if plan.format == "pack-quantized":
        out[f"{p}.weight_packed"] = pack_int32(q.codes.to(torch.int8), w.bits, dim=1)
        out[f"{p}.weight_shape"] = torch.tensor(list(q.codes.shape), dtype=torch.int64)
        if q.zero is not None:
            zero = q.zero.to(torch.int8)
            out[f"{p}.weight_zero_point"] = (zero if w.strategy == "tensor"
                                             else pack_int32(zero, w.bits, dim=0))
    else:
        out[f"{p}.weight"] = q.codes
        if q.zero is not None:
            out[f"{p}.weight_zero_point"] = q.zero.to(torch.int8)
    out[f"{p}.weight_scale"] = q.scale.to(dtype)
    if q.input_scale is not None:
        out[f"{p}.input_scale"] = q.input_scale.reshape(1).to(dtype)
        if q.input_zero is not None:
            out[f"{p}.input_zero_point"] = q.input_zero.reshape(1).to(torch.int8)
    return {k: v.contiguous().cpu() for k, v in out.items()}


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty(0, dtype=self.dtype).element_size()


def module_tensor_specs(plan: ModulePlan, dtype: torch.dtype) -> dict[str, TensorSpec]:
    """Names, dtypes and shapes :func:`module_tensors` will produce, known before running."""
    w, p = plan.weight, plan.name
    rows, cols = plan.out_features, plan.in_features
    scale_shape = {"tensor": (1,), "channel": (rows, 1)}.get(
        w.strategy, (rows, cols // (w.group_size or cols)))
    out: dict[str, TensorSpec] = {}
    if plan.format == "pack-quantized":
        out[f"{p}.weight_packed"] = TensorSpec(torch.int32, (rows, math.ceil(cols * w.bits / 32)))
        out[f"{p}.weight_shape"] = TensorSpec(torch.int64, (2,))
        if not w.symmetric:
            out[f"{p}.weight_zero_point"] = (
                TensorSpec(torch.int8, (1,)) if w.strategy == "tensor"
                else TensorSpec(torch.int32, (math.ceil(rows * w.bits / 32), scale_shape[1])))
    else:
        codes = torch.float8_e4m3fn if w.type == "float" else torch.int8
        out[f"{p}.weight"] = TensorSpec(codes, (rows, cols))
        if not w.symmetric:
            out[f"{p}.weight_zero_point"] = TensorSpec(torch.int8, scale_shape)
    out[f"{p}.weight_scale"] = TensorSpec(dtype, scale_shape)
    if plan.act is not None and not plan.act.dynamic:
        out[f"{p}.input_scale"] = TensorSpec(dtype, (1,))
        if not plan.act.symmetric:
            out[f"{p}.input_zero_point"] = TensorSpec(torch.int8, (1,))
    return out


class PlannedWriter:
    """Safetensors shards whose layout is fixed before any tensor exists.

    Every output tensor's name, dtype and shape is known from the plan, so the headers
    are written first and each tensor goes straight to its offset as soon as it is
    computed: nothing accumulates in memory, whatever the model size. ``finish`` checks
    that every planned tensor arrived. ``transform`` (gpt-oss's experts in vLLM's form,
    :class:`llmctl.quant.vllm_gpt_oss.Interleaver`) renames and joins the tensors given
    to :meth:`add` into the planned ones; ``specs`` are then its output's.
    """

    def __init__(self, directory: Path, specs: dict[str, TensorSpec],
                 max_shard_bytes: int = 2 << 30, transform=None) -> None:
        self.directory = Path(directory)
        self.specs = specs
        self.transform = transform
        shards: list[list[str]] = [[]]
        size = 0
        for name, spec in specs.items():
            if shards[-1] and size + spec.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += spec.nbytes
        n = len(shards)
        self.files = (["model.safetensors"] if n == 1
                      else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
        self.where: dict[str, tuple[int, int]] = {}  # name -> (shard, absolute offset)
        self.handles = []
        for index, (names, file) in enumerate(zip(shards, self.files)):
            header: dict = {"__metadata__": {"format": "pt"}}
            offset = 0
            for name in names:
                spec = specs[name]
                header[name] = {"dtype": DTYPES[dtype_name(spec.dtype)].safetensors,
                                "shape": list(spec.shape),
                                "data_offsets": [offset, offset + spec.nbytes]}
                offset += spec.nbytes
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
            handle = open(self.directory / file, "wb")  # noqa: SIM115 - closed in finish/close
            handle.write(struct.pack("<Q", len(raw)) + raw)
            handle.truncate(8 + len(raw) + offset)
            self.handles.append(handle)
            base = 8 + len(raw)
            for name in names:
                self.where[name] = (index, base + header[name]["data_offsets"][0])
        self.written: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.transform is None:
            self._put(name, tensor)
            return
        for out_name, out_tensor in self.transform.feed(name, tensor):
            self._put(out_name, out_tensor)

    def _put(self, name: str, tensor: torch.Tensor) -> None:
        spec = self.specs.get(name)
        if spec is None:
            raise RuntimeError(f"internal error: {name} is not in the output plan")
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise RuntimeError(f"internal error: {name} is {tensor.dtype} {tuple(tensor.shape)}, "
                               f"planned {spec.dtype} {spec.shape}")
        shard, offset = self.where[name]
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        handle = self.handles[shard]
        handle.seek(offset)
        handle.write(data.tobytes())
        self.written.add(name)

    def add_all(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            self.add(name, tensor)

    def close(self) -> None:
        for handle in self.handles:
            handle.close()
        self.handles = []

    def finish(self) -> list[str]:
        """Close the shards and write the index; returns the file names."""
        missing = [n for n in self.specs if n not in self.written]
        self.close()
        if missing:
            raise RuntimeError(f"internal error: {len(missing)} planned tensors were not written "
                               f"(first: {missing[0]})")
        if len(self.files) > 1:
            weight_map = {name: self.files[self.where[name][0]] for name in self.specs}
            total = sum(spec.nbytes for spec in self.specs.values())
            (self.directory / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2,
                sort_keys=True))
        return list(self.files)


def quantization_config(plan: QuantPlan):
    from compressed_tensors.quantization import QuantizationConfig

    return QuantizationConfig(config_groups=dict(plan.groups), ignore=list(plan.ignore),
                              format=plan.format, quantization_status="compressed",
                              kv_cache_scheme=plan.kv_cache_scheme)


def write_config(directory: Path, config: dict, plan: QuantPlan) -> None:
    """config.json with ``quantization_config``, written by compressed-tensors itself."""
    from compressed_tensors.compressors import ModelCompressor

    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    ModelCompressor(quantization_config=quantization_config(plan)).update_config(str(directory))


def copy_side_files(source: Path, directory: Path) -> list[str]:
    """Tokenizer, chat template, generation config, licence...: everything but weights."""
    copied = []
    for path in sorted(Path(source).iterdir()):
        if (path.is_file() and path.name not in SKIP_SIDE_FILES
                and not path.name.endswith(SKIP_SUFFIXES) and not path.name.startswith(".")):
            shutil.copy2(path, directory / path.name)
            copied.append(path.name)
    return copied
