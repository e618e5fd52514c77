"""Write a Hugging Face checkpoint of a family llmctl runs as a GGUF file llama.cpp loads.

Tensor names and conversions come from the family table (:mod:`llmctl.models.architectures`);
each arch's own keys, generated tensors and refusals from :mod:`llmctl.gguf.families`.

The writer streams: tensor infos go into the header first, then each tensor is read
from the safetensors (memory-mapped), converted/quantized and written before the
next is touched, so memory stays at about one tensor. The per-tensor types come from
a plan (:func:`plan_tensors`) that ``--dry-run`` can print before anything runs.

A *skeleton* is the same file with the data section left as a sparse hole: a valid
GGUF of the right size that llama.cpp's quantizer can dry-run on without llmctl
reading or writing any weights.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmctl.errors import NotAModelError, UsageError
from llmctl.gguf import quants
from llmctl.gguf.families import (
    check_exportable,
    export_config,
    export_warnings,
    generated_tensors,
    write_arch_metadata,
)
from llmctl.gguf.tokenizer import GGUFVocab, read_hf_vocab, write_vocab
from llmctl.gguf.types import file_type
from llmctl.models import gguf_experts
from llmctl.models.architectures import (
    GGUF_CONFIG_KEYS,
    Architecture,
    expand_tensor_names,
    get_architecture,
    to_gguf,
)
from llmctl.models.spec import ModelArch
from llmctl.utils.atomic import atomic_path
from llmctl.utils.dtypes import SAFETENSORS

Progress = Callable[[int, int], None]

_FLOAT_KEYS = {"rope_theta", "rms_norm_eps"}
# ggml types llmctl can produce itself: floats plus the legacy block quantizers.
WRITABLE = ("F32", "F16", *quants.QUANTS)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorPlan:
    name: str  # GGUF tensor name
    source: str | None  # HF parameter name (None for generated tensors)
    shape: tuple[int, ...]  # PyTorch order, rows first
    type: str  # ggml type
    n_bytes: int
    note: str = ""  # why this type: override, fallback, 1-D, ...
    parts: tuple[str, ...] = ()  # HF tensors stacked into this one (a layer's experts)
    cut: gguf_experts.Cut | None = None  # cut out of a fused HF tensor (gpt-oss's experts)

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "shape": list(self.shape)}


@dataclass(frozen=True)
class SourceTensor:
    hf_name: str
    gguf_name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch."
    parts: tuple[str, ...] = ()  # stacked HF tensors (llmctl.gguf.experts); hf_name: their pattern
    cut: gguf_experts.Cut | None = None  # hf_name: the fused tensor it is cut out of


def read_config(directory: Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise NotAModelError(f"{directory} has no config.json",
                             "pass a Hugging Face checkpoint directory")
    return json.loads(path.read_text())


def _safetensors_files(directory: Path) -> list[Path]:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise NotAModelError(f"{directory} has no *.safetensors weights",
                             "save the model with safetensors (save_pretrained does by default)")
    return files


def _header(file: Path) -> dict[str, Any]:
    """A safetensors header without touching the data (8-byte length + JSON)."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def source_tensors(directory: Path, config: dict[str, Any], arch: Architecture
                   ) -> list[SourceTensor]:
    """The checkpoint's tensors in GGUF order (embeddings, blocks, norm, output)."""
    layers = config["num_hidden_layers"]
    names = expand_tensor_names(arch, layers)
    stacked: dict[str, tuple[str, ...]] = {}
    cuts: dict[str, gguf_experts.Cut] = {}
    if arch.moe is not None:
        names.update(gguf_experts.single_names(arch, layers))
        stacked = gguf_experts.stacked_names(arch, layers, ModelArch.from_config(config).num_experts)
        cuts = gguf_experts.cut_names(arch, layers)
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in _safetensors_files(directory):
        for key, info in _header(file).items():
            if key != "__metadata__":
                code = info["dtype"]
                dtype = SAFETENSORS[code].name if code in SAFETENSORS else code
                found[key] = (tuple(info["shape"]), dtype)
    in_stacks = {part for parts in stacked.values() for part in parts}
    in_stacks |= {c.source + suffix for c in cuts.values() for suffix in _FUSED_FORMS}
    unknown = sorted(k for k in found if k not in names and k not in in_stacks
                     and not k.endswith("rotary_emb.inv_freq"))
    if unknown:
        raise NotAModelError(
            f"{directory} has tensors llmctl cannot map to GGUF: {unknown[:3]}"
            + (" ..." if len(unknown) > 3 else ""),
            f"llmctl converts the plain {arch.model_type} layout; merge adapters first",
        )
    tied = ModelArch.from_config(config).tie_word_embeddings
    out = []
    for hf_name, gguf_name in names.items():
        if hf_name in found and not (tied and hf_name == "lm_head.weight"):
            shape, dtype = found[hf_name]
            out.append(SourceTensor(hf_name, gguf_name, shape, dtype))
    for gguf_name, parts in stacked.items():
        missing = [p for p in parts if p not in found]
        if missing:
            raise NotAModelError(
                f"{directory} has no per-expert tensor {missing[0]}",
                "GGUF export stacks the per-expert tensors transformers' save_pretrained "
                "writes; re-save the model with it")
        shape, dtype = found[parts[0]]
        pattern = parts[0].replace("experts.0.", "experts.{e}.")
        out.append(SourceTensor(pattern, gguf_name, (len(parts), *shape), dtype, parts))
    out += [_cut_source(directory, found, gguf_name, cut) for gguf_name, cut in cuts.items()]
    return sorted(out, key=_file_order)


# a fused tensor's forms on disk: float, or MXFP4 blocks and scales (llmctl.quant.mxfp4)
_FUSED_FORMS = ("", "_blocks", "_scales")


def _cut_source(directory: Path, found: dict[str, tuple[tuple[int, ...], str]],
                gguf_name: str, cut: gguf_experts.Cut) -> SourceTensor:
    """A GGUF tensor cut out of a fused one, its shape from the fused one's, rows first."""
    if cut.source in found:
        shape, dtype = found[cut.source]
        if cut.x_at_w:
            shape = (shape[0], shape[2], shape[1])
    elif f"{cut.source}_blocks" in found:
        blocks, _ = found[f"{cut.source}_blocks"]  # [E, out, in / 32, 16]
        # decoded, MXFP4's values (a 2-bit significand times a power of two) are exact in
        # bfloat16: the intermediate type a llama.cpp quantization starts from
        shape, dtype = (*blocks[:2], blocks[2] * blocks[3] * 2), "bfloat16"
    else:
        raise NotAModelError(f"{directory} has neither {cut.source} nor {cut.source}_blocks",
                             "the weights do not match config.json; re-save the model")
    return SourceTensor(cut.source, gguf_name, cut.shape(shape), dtype, cut=cut)


def _file_order(t: SourceTensor) -> tuple[int, int]:
    """token_embd, then block by block, then output_norm/output (convert_hf_to_gguf's
    order; llama-quantize counts layers in file order for its mixtures)."""
    m = re.match(r"blk\.(\d+)\.", t.gguf_name)
    if m:
        return 1, int(m[1])
    return (0, 0) if t.gguf_name.startswith("token_embd") else (2, 0)


def source_dtype(tensors: list[SourceTensor]) -> str:
    """The dtype most of the weights are stored in."""
    counts: dict[str, int] = {}
    for t in tensors:
        counts[t.dtype] = counts.get(t.dtype, 0) + math.prod(t.shape)
    return max(counts, key=counts.get) if counts else "float32"


def type_nbytes(shape: tuple[int, ...], type_name: str) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    return math.prod(shape) // block * size


def _fits(shape: tuple[int, ...], type_name: str) -> bool:
    import gguf

    block, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    return shape[-1] % block == 0


def plan_tensors(tensors: list[SourceTensor], default_type: str, *,
                 overrides: list[tuple[str, str]] = (), output_type: str | None = None,
                 token_embd_type: str | None = None, tied: bool = False,
                 extra: list[TensorPlan] = (), expert_type: str | None = None
                 ) -> list[TensorPlan]:
    """Per-tensor types for a file llmctl writes itself.

    Mirrors llama-quantize's rules where they apply to the types llmctl writes:
    1-D tensors (norms, biases) stay F32; ``output_type``/``token_embd_type`` win
    (with tied embeddings token_embd *is* the output and takes ``output_type``);
    then the first override whose regex is found in the name; else ``expert_type`` for
    the 3-D expert stacks (MXFP4_MOE's MXFP4) and ``default_type`` for the rest; a row
    length that does not fit the type's block falls back to F16.
    """
    plans = []
    for t in tensors:
        note = ""
        if len(t.shape) < 2:
            kind, note = "F32", "1-D"
        elif not t.gguf_name.endswith(".weight"):
            # llama.cpp's converter keeps every bias F32 and llama-quantize leaves them
            # (it quantizes only "*weight"): gpt-oss's stacked expert biases [E, out]
            kind, note = "F32", "bias"
        elif t.gguf_name == "output.weight" and output_type:
            kind, note = output_type, "output_type"
        elif t.gguf_name == "token_embd.weight" and tied and output_type and not token_embd_type:
            kind, note = output_type, "output_type (tied embeddings)"
        elif t.gguf_name == "token_embd.weight" and token_embd_type:
            kind, note = token_embd_type, "token_embd_type"
        else:
            kind = expert_type if expert_type and len(t.shape) == 3 else default_type
            for pattern, type_name in overrides:
                if re.search(pattern, t.gguf_name):
                    kind, note = type_name, f"override {pattern!r}"
                    break
        if kind not in WRITABLE:
            raise UsageError(f"llmctl cannot write {kind} tensors itself ({t.gguf_name})",
                             "use engine llama.cpp (installed with llama-cpp-python) for "
                             "K-quant and i-quant types")
        if not _fits(t.shape, kind):
            note = f"fallback: {t.shape[-1]} columns do not fit {kind} blocks"
            kind = "F16"
        plans.append(TensorPlan(t.gguf_name, t.hf_name, t.shape, kind,
                                type_nbytes(t.shape, kind), note, t.parts, t.cut))
    return plans + list(extra)


def _write_metadata(writer, config: dict[str, Any], arch: Architecture, name: str,
                    ftype: int, vocab: GGUFVocab) -> None:
    import gguf

    writer.add_name(name)
    writer.add_file_type(ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    spec, cfg = ModelArch.from_config(config), export_config(config)
    for key, hf_key in GGUF_CONFIG_KEYS.items():
        value = spec.rope["rope_theta"] if hf_key == "rope_theta" else cfg.get(hf_key)
        if hf_key == "head_dim":
            value = spec.head_dim
        if value is None:
            continue
        full = key.format(arch=arch.gguf_arch)
        if hf_key in _FLOAT_KEYS:
            writer.add_float32(full, float(value))
        else:
            writer.add_uint32(full, int(value))
    write_arch_metadata(writer, config)
    # llama.cpp derives the V head size from hidden/heads unless told (Qwen3: 128 != 64/4).
    writer.add_value_length(spec.head_dim)
    params = spec.rope
    kind = str(params["rope_type"]).lower()
    if kind in ("linear", "yarn") and params.get("factor"):
        writer.add_rope_scaling_type(gguf.RopeScalingType[kind.upper()])
        writer.add_rope_scaling_factor(float(params["factor"]))
        if kind == "yarn" and params.get("original_max_position_embeddings"):
            writer.add_rope_scaling_orig_ctx_len(int(params["original_max_position_embeddings"]))
    write_vocab(writer, vocab)


def _load_array(handle, hf_name: str) -> np.ndarray:
    # framework="pt": numpy has no bfloat16, and most HF checkpoints are stored in it.
    return handle.get_tensor(hf_name).float().numpy()


def _load_cut(handles: dict[str, Any], cut: gguf_experts.Cut) -> np.ndarray:
    """The part of a fused tensor ``cut`` takes, rows first in float32: cut before it is
    widened or decoded (a layer's gate_up is the largest tensor gpt-oss has), a float
    ``x @ W`` weight transposed, MXFP4 decoded as transformers decodes it (exact)."""
    import torch

    if cut.source in handles:
        tensor = handles[cut.source].get_tensor(cut.source)
        tensor = cut.take(tensor.transpose(1, 2) if cut.x_at_w else tensor)
        return np.ascontiguousarray(tensor.float().numpy())
    from llmctl.quant import mxfp4

    blocks, scales = (cut.take(handles[f"{cut.source}{s}"].get_tensor(f"{cut.source}{s}"))
                      for s in ("_blocks", "_scales"))  # [E, out, in / 32, 16], [E, out, in / 32]
    return mxfp4.dequantize(blocks, scales, torch.float32).numpy()


def _encode(array: np.ndarray, type_name: str, threads: int | None) -> np.ndarray:
    if type_name == "F32":
        return np.ascontiguousarray(array, dtype=np.float32)
    if type_name == "F16":
        return np.ascontiguousarray(array, dtype=np.float16)
    return quants.quantize(array, type_name, threads=threads)


def _open_sources(directory: Path) -> Iterator[tuple[str, Any]]:
    from safetensors import safe_open

    for file in _safetensors_files(directory):
        handle = safe_open(str(file), framework="pt")
        for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
            yield key, handle


def write_gguf(directory: Path, out: Path, plan: list[TensorPlan], ftype: int, *,
               vocab: GGUFVocab | None = None, progress: Progress | None = None,
               skeleton: bool = False, threads: int | None = None) -> Path:
    """Write ``directory``'s model to ``out`` with the types in ``plan`` (atomically)."""
    import gguf

    directory = Path(directory)
    config = read_config(directory)
    arch = get_architecture(config["model_type"])
    vocab = vocab or read_hf_vocab(directory, config)
    extra = generated_tensors(config)
    spec = ModelArch.from_config(config)
    n_head, n_kv = spec.num_heads, spec.num_kv_heads
    with atomic_path(Path(out)) as tmp:
        writer = gguf.GGUFWriter(None, arch.gguf_arch)
        _write_metadata(writer, config, arch, directory.name, ftype, vocab)
        for p in plan:
            qtype = gguf.GGMLQuantizationType[p.type]
            if p.type in ("F32", "F16"):
                dtype = np.float32 if p.type == "F32" else np.float16
                writer.add_tensor_info(p.name, p.shape, np.dtype(dtype), p.n_bytes)
            else:
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                byte_shape = (*p.shape[:-1], p.shape[-1] // block * size)
                writer.add_tensor_info(p.name, byte_shape, np.dtype(np.uint8), p.n_bytes,
                                       raw_dtype=qtype)
        writer.open_output_file(tmp)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        if skeleton:
            fout = writer.fout[0]
            align = writer.data_alignment
            end = writer.ggml_pad(fout.tell(), align)
            end += sum(writer.ggml_pad(p.n_bytes, align) for p in plan)
            fout.truncate(end)  # a sparse hole: no weights read, no disk used
            writer.close()
            return Path(out)
        handles = dict(_open_sources(directory))
        for done, p in enumerate(plan, start=1):
            if p.source is None:
                array = extra[p.name]
            elif p.cut is not None:  # gpt-oss's gate, up or down experts (or their biases)
                array = _load_cut(handles, p.cut)
            elif p.parts:  # a layer's experts, stacked [E, out, in]
                array = np.stack([to_gguf(arch, part, _load_array(handles[part], part),
                                          n_head, n_kv) for part in p.parts])
            else:
                array = to_gguf(arch, p.source, _load_array(handles[p.source], p.source),
                                n_head, n_kv)
            data = _encode(array, p.type, threads)
            writer.write_tensor_data(data)
            del array, data
            if progress:
                progress(done, len(plan))
        writer.close()
    return Path(out)


def build_plan(directory: Path, default_type: str, **rules: Any
               ) -> tuple[dict[str, Any], list[SourceTensor], list[TensorPlan]]:
    """Config, source tensors and the per-tensor plan for a file llmctl writes."""
    config = read_config(directory)
    arch = get_architecture(config["model_type"])
    check_exportable(config)
    for warning in export_warnings(config):
        log.warning("GGUF export: %s", warning)
    tensors = source_tensors(directory, config, arch)
    extra = [TensorPlan(name, None, a.shape, "F32", a.nbytes, "generated")
             for name, a in generated_tensors(config).items()]
    tied = ModelArch.from_config(config).tie_word_embeddings
    plan = plan_tensors(tensors, default_type, tied=tied, extra=extra, **rules)
    return config, tensors, plan


def export_gguf(directory: Path, out: Path, out_type: str = "F32",
                progress: Progress | None = None, pre: str | None = None) -> Path:
    """Convert with one type for every 2-D weight (F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1)."""
    ft = file_type(out_type)
    if ft.writer != "llmctl":
        raise UsageError(f"{ft.name} is written by llama.cpp, not by export_gguf",
                         "use llmctl.gguf.export.quantize_to_gguf")
    directory = Path(directory)
    config, _, plan = build_plan(directory, ft.tensor_type, expert_type=ft.expert_type)
    vocab = read_hf_vocab(directory, config, pre=pre)
    return write_gguf(directory, out, plan, ft.ftype, vocab=vocab, progress=progress)


