"""Write a Hugging Face Llama-family checkpoint as a GGUF file llama.cpp loads."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from llmctl.errors import UsageError
from llmctl.gguf.tokenizer import read_hf_vocab, write_vocab
from llmctl.models.architectures import (
    GGUF_CONFIG_KEYS,
    expand_tensor_names,
    get_architecture,
    rope_permute,
)
from llmctl.utils.atomic import atomic_path

# Output type name -> (GGML tensor type, general.file_type). Quantized types only
# apply to 2-D weights; norms and other 1-D tensors stay F32, as llama.cpp does.
FILE_TYPES: dict[str, tuple[str, int]] = {
    "F32": ("F32", 0),
    "F16": ("F16", 1),
    "BF16": ("BF16", 32),
    "Q8_0": ("Q8_0", 7),
    "Q4_0": ("Q4_0", 2),
    "Q4_1": ("Q4_1", 3),
    "Q5_0": ("Q5_0", 8),
    "Q5_1": ("Q5_1", 9),
}

_FLOAT_KEYS = {"rope_theta", "rms_norm_eps"}

Progress = Callable[[int, int], None]


def _load_state(directory: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    state: dict[str, np.ndarray] = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def _tensor_bytes(array: np.ndarray, type_name: str):
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    if qtype == gguf.GGMLQuantizationType.F32:
        return array.astype(np.float32), None
    if qtype == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16), None
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def export_gguf(directory: Path, out: Path, out_type: str = "F32",
                progress: Progress | None = None, pre: str = "default") -> Path:
    import gguf

    if out_type not in FILE_TYPES:
        raise UsageError(f"unknown GGUF type {out_type!r}",
                         f"llmctl writes: {', '.join(FILE_TYPES)}")
    config = json.loads((directory / "config.json").read_text())
    arch = get_architecture(config["model_type"])
    state = _load_state(directory)
    n_blocks = config["num_hidden_layers"]
    names = expand_tensor_names(arch, n_blocks)
    tensor_type, file_type = FILE_TYPES[out_type]
    with atomic_path(out) as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch.gguf_arch)
        writer.add_name(directory.name)
        writer.add_file_type(file_type)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for key, hf_key in GGUF_CONFIG_KEYS.items():
            value = config.get(hf_key)
            if hf_key == "rope_theta":
                value = (config.get("rope_parameters") or {}).get("rope_theta", value)
            if value is None:
                continue
            full = key.format(arch=arch.gguf_arch)
            if hf_key in _FLOAT_KEYS:
                writer.add_float32(full, float(value))
            else:
                writer.add_uint32(full, int(value))
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        writer.add_rope_dimension_count(head_dim)
        write_vocab(writer, read_hf_vocab(directory, config, pre=pre))
        n_head, n_kv = config["num_attention_heads"], config.get("num_key_value_heads")
        items = [(n, state[n]) for n in names if n in state]
        if config.get("tie_word_embeddings"):
            items = [(n, a) for n, a in items if n != "lm_head.weight"]
        for done, (hf_name, array) in enumerate(items, start=1):
            array = array.astype(np.float32)
            if arch.rope_permute and hf_name.endswith("q_proj.weight"):
                array = rope_permute(array, n_head)
            elif arch.rope_permute and hf_name.endswith("k_proj.weight"):
                array = rope_permute(array, n_kv or n_head)
            kind = tensor_type if array.ndim == 2 else "F32"
            data, raw = _tensor_bytes(array, kind)
            if raw is None:
                writer.add_tensor(names[hf_name], data)
            else:
                writer.add_tensor(names[hf_name], data, raw_dtype=raw)
            if progress:
                progress(done, len(items))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out
