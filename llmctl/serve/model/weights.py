"""Read a checkpoint directory (safetensors, plain or compressed-tensors) into a model.

Tensors are read one at a time from memory-mapped safetensors files, so peak memory is
the model in its final form plus one layer in flight. q/k/v and gate/up are fused into
one linear each when their formats allow (fewer, larger matmuls per step). A GGUF file's
quantized tensors come through :class:`llmctl.serve.model.gguf_weights.GGUFWeights` instead:
any reader with ``name in reader``, ``reader(name)`` and ``reader.layer_weight(name)``.

A mixture-of-experts layer's experts are stacked into ``[E, 2I, H]`` (gate rows, then up
rows) and ``[E, H, I]`` tensors (:class:`llmctl.models.layers.moe.MoeWeights`), from the
per-expert names ``save_pretrained`` writes (``experts.{e}.gate_proj`` / Mixtral's
``w1``, ``w3``, ``w2``) or transformers 5's fused 3-D ``experts.gate_up_proj`` and
``experts.down_proj``. Integer experts (compressed-tensors int4/int8; a GGUF reader
answers experts in float) become one :class:`llmctl.serve.layers.lowbit.LowBitLinear`
each (gate and up rows joined; one copy of the codes, not the VNNI kernel's second)
where the dense layers would get that kernel (:func:`kernel_linear`: the CPU,
``quant_backend`` "kernel", a layout it fits), else are dequantized once at load.
gpt-oss's experts come only fused and stored as ``x @ W`` (``[E, H, 2I]``, ``[E, I,
H]``, transposed here), with ``_bias`` tensors, as float or as MXFP4 ``_blocks`` /
``_scales`` (``quant_method: mxfp4``): on the kernel path each expert is a LowBitLinear
holding its 4-bit E2M1 codes as they are, looked up in the kernels' table
(:func:`llmctl.quant.mxfp4.nibble_codes`: exact; 0.53 bytes per weight: the scales as E8M0 bytes), its bias
inside; elsewhere decoded at load to
the compute dtype exactly as transformers decodes them (:mod:`llmctl.quant.mxfp4`). Its
attention sinks are read in float32. A gpt-oss checkpoint ``llmctl quantize`` wrote (per
expert, llm-compressor's linearization: ``experts.{e}.gate_proj`` ... with ``.bias``) goes
through the same per-expert path as the other families (:meth:`_ModelBuilder.experts`),
its gate and up rows interleaved and its biases joined to match the fused form; in vLLM's
streamed form (``experts.{e}.w13_weight_packed`` ..., :mod:`llmctl.quant.vllm_gpt_oss`) the
reader answers those per-linear names from the stored rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmctl.errors import NotAModelError, UnsupportedArchitectureError
from llmctl.models.layers.moe import MoeWeights, Routing
from llmctl.models.spec import FAMILIES, NORM_LAYOUTS, ModelArch, MoeLayout
from llmctl.quant import mxfp4, vllm_gpt_oss
from llmctl.serve.layers.lowbit import (
    AffineCodes,
    LowBitLinear,
    fast_fits,
    quantize_int8,
)
from llmctl.serve.layers.quant_config import QuantConfig
from llmctl.serve.layers.quant_linear import (
    ConcatLinear,
    QuantWeight,
    concat_quant,
    dense_linear,
    kernel_linear,
    load_quant_weight,
    make_linear,
)
from llmctl.serve.layers.rope import interleave_rows, rotary_dim
from llmctl.serve.model.decoder import Layer, LlamaModel, ModelSpec
from llmctl.utils.cpu import cpu_flags


def _map_rows(weight, fn):
    """``fn`` over the output rows of a weight: a tensor, integer codes with their scales,
    or a compressed-tensors weight (its codes, scales and zero points alike)."""
    if isinstance(weight, AffineCodes):
        return weight.map_rows(fn)
    if isinstance(weight, QuantWeight):
        return QuantWeight(
            q=fn(weight.q), scale=fn(weight.scale),
            zero_point=None if weight.zero_point is None else fn(weight.zero_point),
            group_size=weight.group_size, num_bits=weight.num_bits)
    return fn(weight)


def _joined(weights: list):
    """One weight of the rows of ``weights`` (layers sharing an input: q/k/v, gate/up), or
    None where their formats differ."""
    kinds = {type(w) for w in weights}
    if len(kinds) != 1:
        return None
    return (torch.cat(weights) if torch.Tensor in kinds
            else AffineCodes.cat(weights) if AffineCodes in kinds
            else concat_quant(weights))


def _paired(weight, interleave: bool):
    """gate rows then up rows (a tensor, integer codes, a bias) as gpt-oss's fused
    experts hold them, interleaved (gate row j at 2j, up row j at 2j + 1: the clamped
    SwiGLU reads ``[..., ::2]`` and ``[..., 1::2]``); as they are unless ``interleave``."""
    if not interleave:
        return weight
    return _map_rows(weight, lambda t: t.unflatten(0, (2, -1)).transpose(0, 1).flatten(0, 1))


def _interleave(weight, num_heads: int, rotated: int | None = None):
    """q/k rows (a tensor, or the rows of integer codes) in the engine's RoPE layout."""
    return _map_rows(weight, lambda t: interleave_rows(t, num_heads, rotated))


class FusedSplit:
    """A reader that also answers the projections a checkpoint stores fused (Phi-3's
    ``qkv_proj`` and ``gate_up_proj``, :data:`llmctl.models.spec.FUSED_PARTS`) by their
    own names, as row slices of the fused weight: the builder then fuses as for any
    family (and permutes q/k rows for RoPE on their own)."""

    def __init__(self, read, spec: ModelSpec, parts: dict[str, tuple[str, ...]],
                 rows: dict[str, tuple[int, ...]]) -> None:
        self.read = read
        self._where: dict[str, tuple[str, int, int]] = {}
        for whole, names in parts.items():
            start = 0
            for name, n in zip(names, rows[whole]):
                self._where[name] = (whole, start, start + n)
                start += n

    def _split(self, name: str) -> tuple[str, int, int] | None:
        prefix, _, rest = name.partition(".layers.")
        layer, _, module = rest.partition(".")
        for part, where in self._where.items():
            if module == part or module.startswith(part + "."):
                whole = f"{prefix}.layers.{layer}.{where[0]}{module[len(part):]}"
                return whole, where[1], where[2]
        return None

    def __contains__(self, name: str) -> bool:
        split = self._split(name)
        return (split[0] if split else name) in self.read

    def __call__(self, name: str) -> torch.Tensor:
        split = self._split(name)
        return self.read(name) if split is None else self.read(split[0])[split[1]:split[2]]

    def layer_weight(self, name: str):
        split = self._split(name)
        if split is None:
            return self.read.layer_weight(name)
        whole, a, b = split
        return _map_rows(self.read.layer_weight(whole), lambda t: t[a:b])


class CheckpointReader:
    """``reader(name) -> tensor`` over every ``*.safetensors`` file of a directory."""

    def __init__(self, path: Path, quantization_config: dict | None = None) -> None:
        from safetensors import safe_open

        self._quant = QuantConfig(quantization_config)
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
        # gpt-oss experts in vLLM's streamed form, answered by their per-linear names
        self._aliases = vllm_gpt_oss.aliases(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where or name in self._aliases

    def names(self) -> list[str]:
        """Every tensor name as the per-linear form has it (streamed experts replaced)."""
        stored = [n for n in self._where if not vllm_gpt_oss.is_streamed(n)]
        return sorted(stored + list(self._aliases))

    def layer_weight(self, name: str) -> torch.Tensor | QuantWeight:
        """A linear layer's weight as a float tensor or a QuantWeight (not yet a kernel)."""
        scheme = self._quant.scheme_for(name)
        if scheme is None or f"{name}.weight_scale" not in self:
            return self(f"{name}.weight")
        return load_quant_weight(self, name, scheme.args, scheme.format)

    def __call__(self, name: str) -> torch.Tensor:
        """An owned copy: a tensor viewing the memory map would keep the whole file
        mapped (and counted in RSS) after loading."""
        alias = self._aliases.get(name)
        if alias is not None:
            scheme = self._quant.scheme_for(name.rsplit(".", 1)[0])
            bits = int(scheme.args.get("num_bits", 4)) if scheme is not None else 4
            # the stored w13 read in place (not copied whole for gate, then for up): only
            # the alias's rows are copied
            return vllm_gpt_oss.read_alias(alias, lambda n: self._where[n].get_tensor(n), bits,
                                           lambda n: self._where[n].get_slice(n).get_shape())
        try:
            return self._where[name].get_tensor(name).clone()
        except KeyError:
            raise NotAModelError(f"the checkpoint has no tensor {name!r}",
                                 "the weights do not match config.json; re-export the model"
                                 ) from None


def load_model(path: Path, *, dtype: torch.dtype, device: torch.device, backend: str,
               max_len: int, spec: ModelSpec | None = None, reader=None,
               lm_head: str = "auto", bf16_gemm: str = "onednn") -> LlamaModel:
    """The engine's model from the checkpoint at ``path`` (or from ``reader``).

    ``lm_head="int8"`` runs the output projection on int8 codes with a scale per 32
    inputs (the tied 49k x 576 head of SmolLM2 is half of a bf16 batch-1 step's bytes);
    "auto" keeps it as the checkpoint has it. ``bf16_gemm``: see
    :class:`llmctl.serve.engine.config.EngineConfig` (:func:`bf16_gemm_plan`).
    """
    spec = spec or ModelSpec.from_dir(path)
    read = reader if reader is not None else CheckpointReader(path, _linear_quant_config(spec))
    family = FAMILIES[spec.model_type]
    if family.fused:
        # part_rows reads the four shape fields ModelSpec shares with ModelArch
        read = FusedSplit(read, spec, family.fused_parts,
                          {f: ModelArch.part_rows(spec, f) for f in family.fused})
    build = _ModelBuilder(read, spec, dtype=dtype, device=device, backend=backend,
                          gemm=bf16_gemm_plan(bf16_gemm, spec, dtype, device))
    layers = [build.layer(i) for i in range(spec.num_layers)]
    embed, head = build.embed_and_head(lm_head)
    return LlamaModel(spec, embed=embed, layers=layers, norm=build.norm("model.norm.weight"),
                      lm_head=head, dtype=dtype, device=device, max_len=max_len)


def _linear_quant_config(spec: ModelSpec) -> dict | None:
    """The quantization_config the linear layers are read under. MXFP4 (gpt-oss's
    ``quant_method: mxfp4``) covers its experts only, decoded by :meth:`_ModelBuilder.
    experts`; every other tensor of such a checkpoint is float."""
    config = spec.quantization_config
    if not config or config.get("quant_method") != "mxfp4":
        return config
    layout = FAMILIES[spec.model_type].moe
    if layout is None or not layout.gpt_oss_experts:
        raise UnsupportedArchitectureError(
            f"quantization method 'mxfp4' on a {spec.model_type} model is not supported",
            "the engine decodes the MXFP4 experts of gpt-oss checkpoints only")
    return None


@dataclass
class _ModelBuilder:
    """The engine's modules from a reader's tensors: one decoder layer at a time, then the
    embedding and the output head, on ``device`` in ``dtype``."""

    read: Any  # a CheckpointReader, or any reader of its interface (module docstring)
    spec: ModelSpec
    dtype: torch.dtype
    device: torch.device
    backend: str
    gemm: str  # the bf16 dense layers' form (bf16_gemm_plan)
    # the projections whose rows take the engine's RoPE layout, and their heads
    rotated: dict[str, int] = field(init=False)
    rotated_dims: int = field(init=False)  # of each q/k head (partial rotary: fewer)

    def __post_init__(self) -> None:
        self.rotated = {"q_proj": self.spec.num_heads, "k_proj": self.spec.num_kv_heads}
        self.rotated_dims = rotary_dim(self.spec.head_dim, self.spec.partial_rotary_factor)

    def tensor(self, name: str) -> torch.Tensor:
        return self.read(name).to(device=self.device, dtype=self.dtype)

    def optional(self, name: str) -> torch.Tensor | None:
        return self.read(name) if name in self.read else None

    def linear(self, weight, bias):
        return make_linear(weight, bias, dtype=self.dtype, device=self.device,
                           backend=self.backend, gemm=self.gemm)

    def fused(self, names: list[str], with_bias: bool):
        """One linear for the projections ``names`` (q/k rows in the RoPE layout), joined
        when their formats allow, else a :class:`ConcatLinear` of one each."""
        weights = [self.read.layer_weight(n) for n in names]
        biases = ([self.optional(f"{n}.bias") for n in names] if with_bias
                  else [None] * len(names))
        for i, name in enumerate(names):
            heads = self.rotated.get(name.rsplit(".", 1)[-1])
            if heads:
                weights[i] = _interleave(weights[i], heads, self.rotated_dims)
                if biases[i] is not None:
                    biases[i] = interleave_rows(biases[i], heads, self.rotated_dims)
        bias = torch.cat(biases) if all(b is not None for b in biases) else None
        joined = _joined(weights)
        if joined is not None:
            return self.linear(joined, bias)
        return ConcatLinear([self.linear(w, b) for w, b in zip(weights, biases)])

    def norm(self, name: str) -> torch.Tensor:
        """An RMSNorm weight with the family's offset folded in (Gemma's ``1 + w``, added
        in float32 as its RMSNorm adds it, then cast)."""
        weight = self.read(name)
        if self.spec.norm_offset:
            weight = weight.float() + self.spec.norm_offset
        return weight.to(device=self.device, dtype=self.dtype)

    def qk_norm(self, attn: str) -> torch.Tensor:
        """q and k's RMSNorm weights in the RoPE row order: per head (qwen3, gemma3) one
        ``[heads + kv_heads, d]`` table; over the projection (olmo2) one vector."""
        spec = self.spec
        q, k = self.norm(f"{attn}.q_norm.weight"), self.norm(f"{attn}.k_norm.weight")
        if spec.qk_norm_over == "head":
            q, k = (interleave_rows(w, 1, self.rotated_dims) for w in (q, k))
            return torch.cat([q.expand(spec.num_heads, -1),
                              k.expand(spec.num_kv_heads, -1)]).contiguous()
        q = interleave_rows(q, spec.num_heads, self.rotated_dims)
        k = interleave_rows(k, spec.num_kv_heads, self.rotated_dims)
        return torch.cat([q, k]).contiguous()

    def layer(self, i: int) -> Layer:
        spec, fused = self.spec, self.fused
        p = f"model.layers.{i}"
        attn, mlp = f"{p}.self_attn", f"{p}.mlp"
        norms = {slot: self.norm(f"{p}.{name}.weight")
                 for slot, name in NORM_LAYOUTS[spec.norms].items()}
        sparse = bool(spec.moe_layers) and spec.moe_layers[i]
        return Layer(
            input_norm=norms.get("input"),
            qkv=fused([f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"], spec.qkv_bias),
            qk_norm=self.qk_norm(attn) if spec.qk_norm else None,
            o=fused([f"{attn}.o_proj"], spec.o_bias),
            attn_out_norm=norms.get("attn_out"), post_norm=norms.get("mlp_in"),
            gate_up=None if sparse else fused([f"{mlp}.gate_proj", f"{mlp}.up_proj"],
                                              spec.mlp_bias),
            down=None if sparse else fused([f"{mlp}.down_proj"], spec.mlp_bias),
            mlp_out_norm=norms.get("mlp_out"), moe=self.moe(p) if sparse else None,
            sinks=self.read(f"{attn}.sinks").to(device=self.device, dtype=torch.float32)
            if spec.attn_sinks else None,
        )

    def float_weight(self, name: str) -> torch.Tensor:
        """Module ``name``'s weight in the model's dtype: integer codes (an expert off the
        low-bit kernel path, :meth:`lowbit_experts`) dequantized once here, as
        transformers decodes them: the quantized model's numbers at float's memory and
        speed. FP8 arrives decoded."""
        weight = self.read.layer_weight(name)
        if isinstance(weight, (QuantWeight, AffineCodes)):
            return weight.dequantize(self.dtype).to(self.device)
        if not isinstance(weight, torch.Tensor):
            raise UnsupportedArchitectureError(
                f"{name} is stored as {type(weight).__name__}, which the engine cannot "
                "decode for a mixture of experts",
                "serve the bf16 or float32 checkpoint, or a compressed-tensors one")
        return weight.to(device=self.device, dtype=self.dtype)

    def gpt_oss_experts(self, p: str, layout: MoeLayout) -> list:
        """``[gate_up, down, gate_up_bias, down_bias]`` of layer ``p``'s gpt-oss experts
        (gate/up rows interleaved as stored): MXFP4 on the kernel path, one 4-bit E2M1
        linear per expert each with its bias inside (the biases then None); else ``[E, 2I, H]``,
        ``[E, H, I]``, ``[E, 2I]``, ``[E, H]`` from float ``x @ W`` tensors or decoded
        MXFP4 (module doc)."""
        names = [f"{p}.{name}" for name in layout.fused]
        biases = [self.tensor(f"{n}_bias") for n in names]
        if all(f"{n}_blocks" in self.read for n in names):
            linears = [self.mxfp4_linears(n, b) for n, b in zip(names, biases)]
            if None not in linears:
                return [*linears, None, None]
        weights = []
        for full in names:
            if f"{full}_blocks" in self.read:
                # [E, out, in / 32, 16] -> [E, out, in]: F.linear's layout as it is stored
                weight = mxfp4.dequantize(self.read(f"{full}_blocks"),
                                          self.read(f"{full}_scales"), self.dtype)
            elif full in self.read:
                weight = self.read(full).transpose(1, 2)  # x @ W: [E, in, out]
            else:
                raise NotAModelError(
                    f"the checkpoint has neither {full} nor {full}_blocks",
                    "the weights do not match config.json; re-export the model")
            weights.append(weight.to(device=self.device, dtype=self.dtype).contiguous())
        return weights + biases

    def mxfp4_linears(self, name: str, bias: torch.Tensor) -> list | None:
        """The MXFP4 experts ``name`` (``[E, out, in / 32, 16]`` blocks) as one low-bit
        linear each on their E2M1 codes (:func:`llmctl.quant.mxfp4.nibble_codes`, the
        kernels' codebook :data:`~llmctl.quant.mxfp4.FP4_TIMES_2`: exact, the same
        numbers transformers decodes), repacked per expert, never widened to int8;
        ``bias [E, out]`` inside; None off the kernel path (:func:`kernel_linear`: every
        expert has the first one's layout)."""
        blocks, scales = self.read(f"{name}_blocks"), self.read(f"{name}_scales")
        linears = []
        for e in range(blocks.shape[0]):
            q, scale = mxfp4.nibble_codes(blocks[e], scales[e])
            codes = AffineCodes(q, scale, None, mxfp4.BLOCK, 4, mxfp4.FP4_TIMES_2)
            linear = kernel_linear(codes, bias[e], backend=self.backend, device=self.device,
                                   one_copy=True)
            if linear is None:
                return None
            linears.append(linear)
        return linears

    def lowbit_experts(self, names: tuple[str, str, str], biases: list,
                       interleave: bool) -> list | None:
        """``[gate_up, down]``: one low-bit linear per expert (gate and up rows joined,
        interleaved for gpt-oss: :func:`_paired`; ``biases``: :meth:`expert_biases`, put
        inside) from the integer codes of the experts ``names`` (``{e}`` patterns), or
        None when they are float or the kernel does not take them (:func:`kernel_linear`,
        every expert decided alike: the layer's experts are all linears or all stacked)."""
        gate, up, down = names
        gate_up, downs = [], []
        for e in range(self.spec.num_experts):
            parts = [self.read.layer_weight(n.format(e=e)) for n in (gate, up, down)]
            if not all(isinstance(w, (QuantWeight, AffineCodes)) for w in parts):
                return None
            joined = _joined(parts[:2])
            if joined is None:
                return None
            pair = [kernel_linear(w, None if b is None else b[e], backend=self.backend,
                                  device=self.device, one_copy=True)
                    for w, b in zip((_paired(joined, interleave), parts[2]), biases)]
            if None in pair:
                return None
            gate_up.append(pair[0])
            downs.append(pair[1])
        return [gate_up, downs]

    def expert_biases(self, names: tuple[str, str, str]) -> list:
        """gpt-oss's per-expert biases as the fused form holds them: ``[E, 2I]`` (gate
        and up interleaved) and ``[E, H]``."""
        gate, up, down = names
        e_range = range(self.spec.num_experts)
        gate_up = torch.stack([_paired(torch.cat([self.tensor(f"{gate.format(e=e)}.bias"),
                                                  self.tensor(f"{up.format(e=e)}.bias")]), True)
                               for e in e_range])
        return [gate_up, torch.stack([self.tensor(f"{down.format(e=e)}.bias") for e in e_range])]

    def per_expert(self, p: str, layout: MoeLayout) -> bool:
        """Whether layer ``p``'s experts are stored one linear each (float or quantized)."""
        gate = f"{p}.{layout.experts[0].format(e=0)}"
        return f"{gate}.weight" in self.read or f"{gate}.weight_packed" in self.read

    def experts(self, p: str, layout: MoeLayout) -> list:
        """``[gate_up, down, gate_up_bias, down_bias]`` of layer ``p``'s per-expert or
        stacked experts: ``[E, 2I, H]`` and ``[E, H, I]`` tensors, or one low-bit linear
        per expert (:meth:`lowbit_experts`, the biases inside); the biases (gpt-oss's
        per-expert linears, written by ``llmctl quantize``) else None."""
        names = tuple(f"{p}.{name}" for name in layout.experts)
        if self.per_expert(p, layout):
            paired = layout.gpt_oss_experts
            biases = self.expert_biases(names) if paired else [None, None]
            lowbit = self.lowbit_experts(names, biases, paired)
            if lowbit is not None:
                return lowbit + [None, None]
            gate, up, down = names
            e_range = range(self.spec.num_experts)
            gate_up = torch.stack([_paired(torch.cat([self.float_weight(gate.format(e=e)),
                                                      self.float_weight(up.format(e=e))]),
                                           paired) for e in e_range])
            return [gate_up, torch.stack([self.float_weight(down.format(e=e))
                                          for e in e_range]), *biases]
        if layout.gpt_oss_experts:
            return self.gpt_oss_experts(p, layout)
        stacked = [f"{p}.{name}" for name in layout.fused]
        missing = [n for n in stacked if n not in self.read]
        if missing:
            raise NotAModelError(
                f"the checkpoint has neither {names[0].format(e=0)}.weight nor {missing[0]}",
                "the weights do not match config.json; re-export the model")
        return [self.read(n).to(device=self.device, dtype=self.dtype) for n in stacked] \
            + [None, None]

    def moe(self, p: str) -> MoeWeights:
        """Layer ``p``'s router, stacked experts and shared expert (module doc)."""
        spec = self.spec
        layout = FAMILIES[spec.model_type].moe
        routing = Routing(spec.num_experts, spec.experts_per_token, spec.norm_topk_prob,
                          layout.float32_weights, layout.routing)
        router = self.float_weight(f"{p}.{layout.router}")
        gate_up, down, gate_up_bias, down_bias = self.experts(p, layout)
        weights = self.packed_experts(MoeWeights(
            router, gate_up, down, routing, gate_up_bias=gate_up_bias, down_bias=down_bias,
            router_bias=self.tensor(f"{p}.{layout.router}.bias") if layout.router_bias
            else None))
        if layout.shared is not None and spec.shared_expert_intermediate_size:
            s_gate, s_up, s_down = (f"{p}.{name}" for name in layout.shared)
            weights.shared_gate_up = torch.cat([self.float_weight(s_gate),
                                                self.float_weight(s_up)])
            weights.shared_down = self.float_weight(s_down)
            weights.shared_gate = self.float_weight(f"{p}.{layout.shared_gate}")
        return weights

    def packed_experts(self, weights: MoeWeights) -> MoeWeights:
        """bf16 experts on the CPU as one native-kernel linear each (the bf16 GEMM of the
        dense layers, ``csrc/gemm_bf16.cpp``, in its "own" form: one copy, any rows; a
        decode step gives each picked expert a few rows, where oneDNN's ``F.linear``
        repacks the weight per call), the biases inside; the stacked tensors are dropped.
        Other dtypes, devices and ``--bf16-gemm onednn`` keep the stacked form, and
        experts already one low-bit linear each stay so."""
        if self.gemm == "onednn" or self.dtype != torch.bfloat16 or self.device.type != "cpu" \
                or not isinstance(weights.gate_up, torch.Tensor):
            return weights
        gate_bias, down_bias = weights.gate_up_bias, weights.down_bias
        weights.gate_up = [dense_linear(w.contiguous(), None if gate_bias is None
                                        else gate_bias[e], gemm="own")
                           for e, w in enumerate(weights.gate_up)]
        weights.down = [dense_linear(w.contiguous(), None if down_bias is None else down_bias[e],
                                     gemm="own") for e, w in enumerate(weights.down)]
        weights.gate_up_bias = weights.down_bias = None
        return weights

    def embed_and_head(self, lm_head: str):
        """The embedding table and the output projection; a tied head's table is read once
        (``lm_head``: see :func:`load_model`)."""
        read, device, dtype = self.read, self.device, self.dtype
        tied = self.spec.tie_word_embeddings or ("lm_head.weight" not in read
                                                 and "lm_head.weight_packed" not in read)
        head_weight = read.layer_weight("model.embed_tokens" if tied else "lm_head")
        if tied and isinstance(head_weight, AffineCodes):
            embed = head_weight.dequantize(dtype).to(device)
        elif tied and isinstance(head_weight, torch.Tensor):
            embed = head_weight.to(device=device, dtype=dtype)  # the same table: read once
        else:
            embed = self.tensor("model.embed_tokens.weight")
        already_int8 = isinstance(head_weight, AffineCodes) and head_weight.bits == 8
        if lm_head == "int8" and device.type == "cpu" and not already_int8:
            if isinstance(head_weight, AffineCodes):
                head_weight = head_weight.dequantize()
            if isinstance(head_weight, torch.Tensor):
                head_weight = quantize_int8(head_weight, 32)
        head = _head_linear(head_weight, device)
        if head is None:
            # tied: a packed layout is a copy (the embedding lookup needs the plain table)
            head = (dense_linear(embed, None, gemm=self.gemm) if tied
                    else self.linear(head_weight, None))
        return embed, head


def dense_parameters(spec: ModelSpec) -> int:
    """Parameters of the matrix products (the output head counted once, tied or not)."""
    attn = spec.hidden_size * (2 * spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    mlp = 3 * spec.hidden_size * spec.intermediate_size
    return spec.num_layers * (attn + mlp) + spec.vocab_size * spec.hidden_size


def bf16_gemm_plan(choice: str, spec: ModelSpec, dtype: torch.dtype,
                   device: torch.device) -> str:
    """The :class:`llmctl.serve.layers.quant_linear.PackedLinear` form of a model's bf16 dense
    layers for the ``bf16_gemm`` setting: "own" and "onednn" as said; "auto" = "own" on
    a CPU without AMX (measured faster than oneDNN at 1-2048 rows, one copy), and with
    AMX oneDNN (its tile kernels, not measured here) plus the own kernel for small
    batches ("both") when that second copy of every dense weight is at most 1/8 of
    physical memory."""
    if dtype != torch.bfloat16 or device.type != "cpu" or choice == "onednn":
        return "onednn"
    if choice == "own" or "amx_bf16" not in cpu_flags():
        return "own"
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return "both" if 2 * dense_parameters(spec) <= memory // 8 else "onednn"


def _head_linear(weight, device: torch.device):
    """Integer codes of the output projection on the low-bit kernel, float32 logits
    out; None when the head is a float tensor (or the kernel is missing)."""
    if isinstance(weight, AffineCodes) and device.type == "cpu" and fast_fits(weight):
        return LowBitLinear(weight, out_float=True)
    return None
