"""The checkpoint a build starts from: where it is, what it is, and its identity.

The source hash is SHA-256 over ``config.json`` and every weight file's own SHA-256
(sorted by name), so two engines built from the same weights name the same source
whatever directory it sat in. A build reads all the weights anyway; hashing them
costs about a second per 500 MB.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from llmctl.models.manifest import file_sha256

# Files copied next to every engine so it is self-contained for tokenization and
# for reading the model's shape (serve and eval need both; weights stay behind).
METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
_WEIGHT_GLOBS = ("*.safetensors", "*.bin")


@dataclass(frozen=True)
class Source:
    reference: str
    path: Path
    config: dict
    sha256: str

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")

    @property
    def quantization(self) -> dict | None:
        return self.config.get("quantization_config")

    def describe_quantization(self) -> str | None:
        q = self.quantization
        if not q:
            return None
        method = q.get("quant_method", "?")
        fmt = q.get("format")
        parts = [f"{method}:{fmt}" if fmt else method]
        for group in (q.get("config_groups") or {}).values():
            w = group.get("weights") or {}
            if w:
                parts.append(f"W{w.get('num_bits')} {w.get('strategy')}"
                             + (f" g{w['group_size']}" if w.get("group_size") else "")
                             + (" sym" if w.get("symmetric", True) else " asym"))
            a = group.get("input_activations") or {}
            if a:
                parts.append(f"A{a.get('num_bits')} {a.get('type', '')}".strip())
        return " ".join(parts)


def source_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    files = [Path(path) / "config.json"] + sorted(
        p for g in _WEIGHT_GLOBS for p in Path(path).glob(g))
    for f in files:
        digest.update(f"{f.name}:{file_sha256(f)}\n".encode())
    return digest.hexdigest()


def resolve_source(reference: str, progress=None) -> Source:
    from llmctl.models.resolve import resolve_model

    resolved = resolve_model(reference, progress=progress)
    config = json.loads((resolved.path / "config.json").read_text())
    return Source(reference=reference, path=resolved.path, config=config,
                  sha256=source_sha256(resolved.path))


def copy_metadata(source: Path, dest: Path, *, drop_quantization: bool) -> None:
    """Config, generation config and tokenizer files into the engine directory.

    ``drop_quantization`` removes ``quantization_config`` from the copy when the engine's
    weights are no longer in the checkpoint's quantized format (the manifest keeps it).
    """
    dest.mkdir(parents=True, exist_ok=True)
    for name in METADATA_FILES:
        src = Path(source) / name
        if not src.is_file():
            continue
        if name == "config.json" and drop_quantization:
            config = json.loads(src.read_text())
            config.pop("quantization_config", None)
            (dest / name).write_text(json.dumps(config, indent=2) + "\n")
        else:
            shutil.copy2(src, dest / name)


def float_checkpoint(source: Source, workdir: Path) -> Path:
    """A float32 HF directory with the source's weights (dequantized if it is quantized).

    The ONNX model builder and torch.export want plain float weights. A compressed-tensors
    checkpoint (what ``llmctl quantize`` writes) is read with the serving engine's reader
    (:mod:`llmctl.serve.layers.quant_linear`) and each quantized layer becomes
    ``(q - zero_point) * scale`` per group: exactly the model llmctl quantized.
    """
    if not source.quantization:
        return source.path
    import torch
    from safetensors.torch import save_file

    from llmctl.serve.layers.quant_config import QuantConfig
    from llmctl.serve.layers.quant_linear import load_quant_weight
    from llmctl.serve.model.weights import CheckpointReader

    read = CheckpointReader(source.path, source.quantization)
    quant = QuantConfig(source.quantization)
    # the per-linear names: gpt-oss experts in vLLM's streamed form read as the others
    names = read.names()
    layers = sorted({n[: -len(".weight_scale")] for n in names if n.endswith(".weight_scale")})
    quant_parts = {f"{layer}.{part}" for layer in layers
                   for part in ("weight_packed", "weight_scale", "weight_zero_point",
                                "weight_shape", "weight_g_idx", "weight")}
    tensors: dict[str, torch.Tensor] = {}
    for layer in layers:
        scheme = quant.scheme_for(layer)
        if scheme is None:
            continue
        weight = load_quant_weight(read, layer, scheme.args, scheme.format)
        tensors[f"{layer}.weight"] = (weight.float() if isinstance(weight, torch.Tensor)
                                      else weight.dequantize(torch.float32)).contiguous()
    for name in names:
        if name not in quant_parts and name not in tensors:
            value = read(name)
            tensors[name] = value.float() if value.is_floating_point() else value
    out = Path(workdir) / "dequantized"
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    copy_metadata(source.path, out, drop_quantization=True)
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
