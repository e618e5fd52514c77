"""Read a GGUF file into Hugging Face terms: a config dict and float tensors.

The model layer reads GGUF (a ``.gguf`` reference becomes a checkpoint through
:mod:`llmctl.models.gguf_import`); :mod:`llmctl.gguf` writes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmctl.errors import GGUFError, ModelNotFoundError
from llmctl.models import gguf_experts
from llmctl.models.architectures import (
    GGUF_ARCH_KEYS,
    GGUF_CONFIG_KEYS,
    GGUF_INT_FIELDS,
    Architecture,
    architecture_for_gguf,
    expand_tensor_names,
    from_gguf,
)

# tensors a converter computes from the config: read back into config.json, not weights
_ROPE_FACTORS = {"rope_factors_long.weight": "long_factor",
                 "rope_factors_short.weight": "short_factor"}
# llama.cpp's sliding-window periods where its graphs find no per-layer key (llama-model.cpp)
_SWA_PERIOD = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2}
_GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

# Arrays longer than this (token lists, merges, scores) are shown as "[N items]".
_MAX_ARRAY_ITEMS = 32


@dataclass(frozen=True)
class TensorEntry:
    name: str
    type: str
    shape: tuple[int, ...]  # in PyTorch order (rows first)
    n_bytes: int


def open_reader(path: Path):
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"no such GGUF file: {path}", "check the path")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 (gguf raises ValueError/struct.error/...)
        raise GGUFError(
            f"cannot read {path} as GGUF: {exc}",
            "the file is damaged or not a GGUF; re-download or re-export it",
        ) from None


def field_value(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def read_metadata(path: Path) -> tuple[dict[str, Any], list[TensorEntry]]:
    """All key/values (long arrays summarised) and the tensor table, of any GGUF."""
    import gguf

    reader = open_reader(path)
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        is_array = field.types and field.types[0] == gguf.GGUFValueType.ARRAY
        if is_array and len(field.data) > _MAX_ARRAY_ITEMS:
            meta[key] = f"[{len(field.data)} items]"
        else:
            meta[key] = field.contents()
    tensors = [
        TensorEntry(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)),
                    int(t.n_bytes))
        for t in reader.tensors
    ]
    return meta, tensors


@dataclass
class GGUFCheckpoint:
    """A GGUF file seen as a Hugging Face model: config plus named float tensors."""

    path: Path
    reader: Any
    arch: Architecture
    config: dict[str, Any]

    @property
    def tensor_count(self) -> int:
        """The file's tensors, a stacked expert tensor counted once per expert and
        gpt-oss's cuts once per fused tensor (what :meth:`tensors` yields, rope factors
        aside)."""
        cuts = self.cut_names()
        return (len(self.reader.tensors) + sum(len(v) - 1 for v in self.expert_names().values())
                - len(cuts) + len({c.source for c in cuts.values()}))

    @property
    def num_experts(self) -> int:
        return int(self.config[self.arch.moe.experts_key[0]]) if self.arch.moe else 0

    def hf_names(self) -> dict[str, str]:
        """GGUF -> HF name of every one-to-one tensor (a MoE's router and shared expert
        too; its stacked experts: :meth:`expert_names`)."""
        layers = self.config["num_hidden_layers"]
        names = expand_tensor_names(self.arch, layers)
        if self.arch.moe:
            names.update(gguf_experts.single_names(self.arch, layers))
        return {g: h for h, g in names.items()}

    def expert_names(self) -> dict[str, tuple[str, ...]]:
        """Stacked GGUF tensor -> the per-expert HF names of its slices, in order."""
        if not self.arch.moe:
            return {}
        return gguf_experts.stacked_names(self.arch, self.config["num_hidden_layers"],
                                          self.num_experts)

    def cut_names(self) -> dict[str, gguf_experts.Cut]:
        """GGUF tensor -> its cut of a fused HF tensor (gpt-oss's experts)."""
        if not self.arch.moe:
            return {}
        return gguf_experts.cut_names(self.arch, self.config["num_hidden_layers"])

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, float32 array) in file order, dequantized and un-permuted; a stacked
        expert tensor gives one array per expert; gpt-oss's cuts one fused tensor, once
        the last of its cuts is read."""
        import gguf

        to_hf = self.hf_names()
        stacked = self.expert_names()
        cuts, pending = self.cut_names(), {}
        n_head = self.config["num_attention_heads"]
        n_kv = self.config["num_key_value_heads"]
        for t in self.reader.tensors:
            hf_name = to_hf.get(t.name)
            if t.name in _ROPE_FACTORS:
                continue  # in config.json's rope_parameters (open_checkpoint)
            if t.name == "rope_freqs.weight":
                raise GGUFError(
                    f"{self.path.name}: Llama 3.1 RoPE scaling (rope_freqs) cannot be read "
                    "back into rope_parameters", "convert from the HF checkpoint instead")
            if hf_name is None and t.name not in stacked and t.name not in cuts:
                raise GGUFError(
                    f"{self.path.name}: unexpected tensor {t.name!r} for a "
                    f"{self.arch.gguf_arch} model",
                    "this GGUF variant is not supported; convert from the HF checkpoint",
                )
            try:
                array = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise GGUFError(
                    f"{self.path.name}: tensor {t.name} uses {t.tensor_type.name}, which "
                    "the gguf package cannot dequantize",
                    "re-export the model with a Q4_0..Q8_0, K-quant or float type",
                ) from None
            array = np.asarray(array, dtype=np.float32).reshape(
                tuple(int(d) for d in reversed(t.shape)))
            if t.name in cuts:  # rows first: joined with the source's other cuts
                got = pending.setdefault(cuts[t.name].source, [])
                got.append((cuts[t.name], array))
                if len(got) == cuts[t.name].parts:
                    yield cuts[t.name].source, gguf_experts.join(pending.pop(cuts[t.name].source))
                continue
            if hf_name is None:  # [E, out, in]: expert e is slice e (no permutation, shift)
                for name, part in zip(stacked[t.name], array, strict=True):
                    yield name, np.array(part, order="C")
                continue
            array = from_gguf(self.arch, hf_name, array, n_head, n_kv)
            # F32 tensors are views of a read-only memmap: copy so torch may own them.
            yield hf_name, np.array(array, copy=not array.flags.writeable, order="C")


def _rope_parameters(reader, arch_name: str, theta: float) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    kind = field_value(reader, f"{arch_name}.rope.scaling.type")
    factor = field_value(reader, f"{arch_name}.rope.scaling.factor")
    if kind and kind != "none" and factor:
        params["rope_type"] = {"linear": "linear", "yarn": "yarn"}.get(kind, kind)
        params["factor"] = float(factor)
        original = field_value(reader, f"{arch_name}.rope.scaling.original_context_length")
        if original:
            params["original_max_position_embeddings"] = int(original)
    return params


def _short(value: Any) -> Any:
    # GGUF stores float32: 1e-5 reads back as 9.9999997e-06. Print it short.
    return float(f"{value:.7g}") if isinstance(value, float) else value


def _arch_fields(reader, gguf_arch: str) -> dict[str, Any]:
    config: dict[str, Any] = {}
    keys = {**GGUF_CONFIG_KEYS, **GGUF_ARCH_KEYS.get(gguf_arch, {})}
    for key, hf_key in keys.items():
        value = field_value(reader, key.format(arch=gguf_arch))
        if value is not None:
            config[hf_key] = int(value) if hf_key in GGUF_INT_FIELDS else _short(value)
    return config


def _layer_types(reader, gguf_arch: str, n_layers: int) -> list[str]:
    """Gemma 2/3's and gpt-oss's sliding layers: the per-layer pattern array, else
    llama.cpp's period."""
    pattern = field_value(reader, f"{gguf_arch}.attention.sliding_window_pattern",
                          _SWA_PERIOD[gguf_arch])
    if isinstance(pattern, list):
        swa = [bool(x) for x in pattern][:n_layers]
    else:  # llama_hparams::set_swa_pattern: the last layer of each period is dense
        swa = [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1
               for i in range(n_layers)]
    return ["sliding_attention" if s else "full_attention" for s in swa]


def _gemma_fields(reader, gguf_arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp's Gemma graphs derive rather than read, as transformers' fields."""
    head_dim, layers = config["head_dim"], config["num_hidden_layers"]
    out: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh",
                           "hidden_act": "gelu_pytorch_tanh"}
    if gguf_arch == "gemma":
        return out
    big = layers == _GEMMA_27B_LAYERS[gguf_arch]
    out["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"]
                                    if big else head_dim)
    out["layer_types"] = _layer_types(reader, gguf_arch, layers)
    if gguf_arch == "gemma2":
        out.update({k: config.get(k, v) for k, v in _GEMMA2_SOFTCAPS.items()})
    else:
        local = float(field_value(reader, "gemma3.rope.freq_base_swa", 10000.0))
        out["rope_parameters"] = {"full_attention": config["rope_parameters"],
                                  "sliding_attention": {"rope_type": "default",
                                                        "rope_theta": _short(local)}}
        out["final_logit_softcapping"] = None
    return out


def _phi3_fields(reader, config: dict[str, Any]) -> dict[str, Any]:
    """Partial rotary and LongRoPE's factors (tensors in the file) as Phi3Config's."""
    out: dict[str, Any] = {}
    dims = field_value(reader, "phi3.rope.dimension_count")
    if dims and int(dims) != config["head_dim"]:
        out["partial_rotary_factor"] = int(dims) / config["head_dim"]
    if not config.get("sliding_window"):
        out["sliding_window"] = None
    factors = {_ROPE_FACTORS[t.name]: [_short(float(x)) for x in t.data]
               for t in reader.tensors if t.name in _ROPE_FACTORS}
    if factors:
        out["rope_parameters"] = {**config["rope_parameters"], "rope_type": "longrope",
                                  **factors}
    return out


def _gpt_oss_fields(reader, config: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp's gpt-oss graph fixes rather than reads, as GptOssConfig's fields:
    biases on q/k/v/o, the sliding layers, YaRN's correction range rounded (truncate) with
    llama.cpp's betas (its SwiGLU constants: gguf_experts.config_fields)."""
    rope = dict(config["rope_parameters"])
    if rope["rope_type"] == "yarn":
        rope.update(truncate=True, beta_fast=32.0, beta_slow=1.0)
    return {"hidden_act": "silu", "attention_bias": True, "rope_parameters": rope,
            "layer_types": _layer_types(reader, "gpt-oss", config["num_hidden_layers"])}


def _family_fields(reader, gguf_arch: str, config: dict[str, Any]) -> dict[str, Any]:
    if gguf_arch.startswith("gemma"):
        return _gemma_fields(reader, gguf_arch, config)
    if gguf_arch == "phi3":
        return _phi3_fields(reader, config)
    if gguf_arch == "gpt-oss":
        return _gpt_oss_fields(reader, config)
    return {"hidden_act": "silu"}


def open_checkpoint(path: Path) -> GGUFCheckpoint:
    reader = open_reader(path)
    gguf_arch = field_value(reader, "general.architecture")
    if gguf_arch is None:
        raise GGUFError(f"{path} has no general.architecture key", "it is not a model GGUF")
    n_experts = int(field_value(reader, f"{gguf_arch}.expert_count") or 0)
    arch = architecture_for_gguf(gguf_arch, experts=n_experts > 0)
    config = _arch_fields(reader, gguf_arch)
    missing = {"num_hidden_layers", "hidden_size", "num_attention_heads"} - config.keys()
    if missing:
        raise GGUFError(f"{path} lacks {sorted(missing)} in its metadata",
                        "the file is incomplete; re-export it")
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    names = {t.name for t in reader.tensors}
    if "vocab_size" not in config:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        config["vocab_size"] = len(tokens.data) if tokens else None
    theta = float(config.pop("rope_theta", 10000.0))
    config.update(
        model_type=arch.model_type,
        architectures=[arch.causal_lm_class],
        tie_word_embeddings="output.weight" not in names,
        rope_parameters=_rope_parameters(reader, gguf_arch, theta),
        # transformers 4.x ignores rope_parameters and silently falls back to 10000.
        rope_theta=theta,
        torch_dtype="float32",
    )
    config.update(_family_fields(reader, gguf_arch, config))
    if n_experts:
        config.update(gguf_experts.config_fields(
            arch, gguf_arch, lambda key: field_value(reader, key)))
    for gguf_key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("padding_token_id", "pad_token_id")):
        value = field_value(reader, f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[hf_key] = int(value)
    return GGUFCheckpoint(Path(path), reader, arch, config)
