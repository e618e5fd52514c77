"""Read a checkpoint directory (safetensors, plain or compressed-tensors) into a model.

Tensors are read one at a time from memory-mapped safetensors files, so peak memory is
the model in its final form plus one layer in flight. q/k/v and gate/up are fused into
one linear each when their formats allow (fewer, larger matmuls per step).
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmctl.errors import NotAModelError
from llmctl.serve.model import Layer, LlamaModel, ModelSpec
from llmctl.serve.quant_linear import (
    ConcatLinear,
    QuantConfig,
    QuantWeight,
    concat_quant,
    dense_linear,
    load_quant_weight,
    make_linear,
)
from llmctl.serve.rope import interleave_rows


def _interleave(weight, num_heads: int):
    """q/k rows (a tensor or the rows of a QuantWeight) in the engine's RoPE layout."""
    if isinstance(weight, QuantWeight):
        return QuantWeight(
            q=interleave_rows(weight.q, num_heads), scale=interleave_rows(weight.scale, num_heads),
            zero_point=(None if weight.zero_point is None
                        else interleave_rows(weight.zero_point, num_heads)),
            group_size=weight.group_size, num_bits=weight.num_bits)
    return interleave_rows(weight, num_heads)


class CheckpointReader:
    """``reader(name) -> tensor`` over every ``*.safetensors`` file of a directory."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise NotAModelError(f"{path} has no *.safetensors weights",
                                 "the engine reads safetensors checkpoints; re-save the model "
                                 "with save_pretrained(safe_serialization=True)")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where: dict[str, object] = {}
        for handle in self._handles:
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                self._where[key] = handle

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __call__(self, name: str) -> torch.Tensor:
        """An owned copy: a tensor viewing the memory map would keep the whole file
        mapped (and counted in RSS) after loading."""
        try:
            return self._where[name].get_tensor(name).clone()
        except KeyError:
            raise NotAModelError(f"the checkpoint has no tensor {name!r}",
                                 "the weights do not match config.json; re-export the model"
                                 ) from None


def load_model(path: Path, *, dtype: torch.dtype, device: torch.device, backend: str,
               max_len: int, spec: ModelSpec | None = None) -> LlamaModel:
    spec = spec or ModelSpec.from_dir(path)
    read = CheckpointReader(path)
    quant = QuantConfig(spec.quantization_config)

    def tensor(name: str) -> torch.Tensor:
        return read(name).to(device=device, dtype=dtype)

    def optional(name: str) -> torch.Tensor | None:
        return read(name) if name in read else None

    def raw_weight(name: str):
        """A layer's weight as a float tensor or a QuantWeight (not yet a kernel)."""
        scheme = quant.scheme_for(name)
        if scheme is None or f"{name}.weight_scale" not in read:
            return read(f"{name}.weight")
        return load_quant_weight(read, name, scheme.args, scheme.format)

    rotated = {"q_proj": spec.num_heads, "k_proj": spec.num_kv_heads}

    def fused(names: list[str], with_bias: bool):
        weights = [raw_weight(n) for n in names]
        biases = [optional(f"{n}.bias") for n in names] if with_bias else [None] * len(names)
        for i, name in enumerate(names):
            heads = rotated.get(name.rsplit(".", 1)[-1])
            if heads:
                weights[i] = _interleave(weights[i], heads)
                if biases[i] is not None:
                    biases[i] = interleave_rows(biases[i], heads)
        bias = torch.cat(biases) if all(b is not None for b in biases) else None
        if all(isinstance(w, torch.Tensor) for w in weights):
            return make_linear(torch.cat(weights), bias, dtype=dtype, device=device,
                               backend=backend)
        if not any(isinstance(w, torch.Tensor) for w in weights):
            joined = concat_quant(weights)
            if joined is not None:
                return make_linear(joined, bias, dtype=dtype, device=device, backend=backend)
        return ConcatLinear([make_linear(w, b, dtype=dtype, device=device, backend=backend)
                             for w, b in zip(weights, biases)])

    def qk_norm(attn: str) -> torch.Tensor:
        """qwen3's per-head q and k RMSNorm weights as one ``[heads + kv_heads, d]`` table."""
        q = interleave_rows(read(f"{attn}.q_norm.weight"), 1)
        k = interleave_rows(read(f"{attn}.k_norm.weight"), 1)
        table = torch.cat([q.expand(spec.num_heads, -1), k.expand(spec.num_kv_heads, -1)])
        return table.to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        attn, mlp = f"{p}.self_attn", f"{p}.mlp"
        layers.append(Layer(
            input_norm=tensor(f"{p}.input_layernorm.weight"),
            qkv=fused([f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"], spec.qkv_bias),
            qk_norm=qk_norm(attn) if spec.qk_norm else None,
            o=fused([f"{attn}.o_proj"], spec.o_bias),
            post_norm=tensor(f"{p}.post_attention_layernorm.weight"),
            gate_up=fused([f"{mlp}.gate_proj", f"{mlp}.up_proj"], spec.mlp_bias),
            down=fused([f"{mlp}.down_proj"], spec.mlp_bias),
        ))
    embed = tensor("model.embed_tokens.weight")
    if spec.tie_word_embeddings or "lm_head.weight" not in read and \
            "lm_head.weight_packed" not in read:
        # tied: a packed layout is a copy (the embedding lookup needs the plain table)
        lm_head = dense_linear(embed, None)
    else:
        lm_head = fused(["lm_head"], False)
    return LlamaModel(spec, embed=embed, layers=layers, norm=tensor("model.norm.weight"),
                      lm_head=lm_head, dtype=dtype, device=device, max_len=max_len)

