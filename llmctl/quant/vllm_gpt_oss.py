"""gpt-oss's quantized experts in the form vLLM's gpt-oss loader reads: names and tensors.

llmctl quantizes gpt-oss's fused experts one linear each (:mod:`llmctl.quant.fused_experts`:
``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` with biases) and writes each in
compressed-tensors form (``.weight_packed``, ``.weight_scale``, ``.weight_shape``). vLLM
0.32's gpt-oss model skips those names silently: for compressed-tensors WNA16 (symmetric
int4/int8 weights, no activation quantization) its ``_try_load_streamed_expert`` reads one
tensor per expert and fused parameter, N-first (``[E, N, K_packed]`` buffers,
``CompressedTensorsWNA16MoEMethod.get_weight_shape``), gate and up rows interleaved as its
swigluoai takes them (gate = ``x[..., ::2]``, up = ``x[..., 1::2]``)::

    mlp.experts.{e}.w13_weight_packed int32 [2I, H * bits / 32]  row 2i: gate row i, 2i+1: up
    mlp.experts.{e}.w13_weight_scale        [2I, H / group]      (channel: [2I, 1])
    mlp.experts.{e}.w13_bias                [2I]
    mlp.experts.{e}.w2_weight_packed  int32 [H, I * bits / 32]
    mlp.experts.{e}.w2_weight_scale         [H, I / group]
    mlp.experts.{e}.w2_bias                 [H]

No ``weight_shape`` and no zero point go under these names: any other name containing
``.w13_weight`` falls into the loader's fused 3-D branch and fails. The config's
``quantization_config`` still names the per-linear modules (vLLM picks the experts' scheme
by matching ``experts.0.gate_proj``), so only tensor names and row order change here.
Everything is pure name/tensor work: the shard planner (:func:`stream_specs`), the writer
(:class:`Interleaver`) and the readers (:func:`aliases`, :func:`to_per_linear`) share it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

_PER_LINEAR = re.compile(r"^(?P<expert>.+\.mlp\.experts\.\d+)\.(?P<part>gate_proj|up_proj|down_proj)"
                         r"\.(?P<tensor>weight_packed|weight_scale|weight_shape|bias)$")
_STREAMED = re.compile(r"^(?P<expert>.+\.mlp\.experts\.\d+)\.(?P<fused>w13|w2)_"
                       r"(?P<tensor>weight_packed|weight_scale|bias)$")
_EXPERT_MODULE = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$")

FORM = ("vLLM's streamed per-expert form (mlp.experts.{e}.w13_weight_packed / w13_weight_scale "
        "/ w13_bias with gate and up rows interleaved, w2_weight_packed / w2_weight_scale / "
        "w2_bias)")
PER_LINEAR_FORM = ("one linear each, as llm-compressor linearizes them (mlp.experts.{e}."
                   "gate_proj / up_proj / down_proj with biases)")


def streamed(modules: Iterable) -> bool:
    """Whether gpt-oss's experts (``modules``: the plan's ModulePlans) are written in vLLM's
    streamed form: every expert linear symmetric pack-quantized int4/int8 weight-only,
    per group or channel, all with one scheme (vLLM holds a layer's experts in one buffer
    with one group size). Anything else (FP8, INT8 W8A8, asymmetric, mixed) keeps the
    per-linear form, which vLLM 0.32 does not load for gpt-oss either way."""
    experts = [m for m in modules if _EXPERT_MODULE.search(m.name)]
    if not experts or not all(m.quantized for m in experts):
        return False
    schemes = {(m.weight.type, m.weight.bits, m.weight.symmetric, m.weight.strategy,
                m.weight.group_size, m.format, m.act is None) for m in experts}
    if len(schemes) != 1:
        return False
    kind, bits, symmetric, strategy, _, fmt, weight_only = schemes.pop()
    return (kind == "int" and bits in (4, 8) and symmetric and strategy in ("group", "channel")
            and fmt == "pack-quantized" and weight_only)


def streamed_name(name: str) -> str | None:
    """The streamed name a per-linear expert tensor goes to ("" when it is dropped: its
    ``weight_shape``), None for any other tensor."""
    match = _PER_LINEAR.match(name)
    if match is None:
        return None
    if match["tensor"] == "weight_shape":  # the streamed form has none (see the module doc)
        return ""
    fused = "w2" if match["part"] == "down_proj" else "w13"
    return f"{match['expert']}.{fused}_{match['tensor']}"


def stream_specs(specs: dict) -> dict:
    """The planned output tensors (name -> spec with ``shape``) with the experts renamed
    and gate/up joined: ``w13`` takes gate's place in the file order, twice its rows."""
    out: dict = {}
    for name, spec in specs.items():
        target = streamed_name(name)
        if target is None:
            out[name] = spec
        elif target and ".w13_" in target:
            if target not in out:
                out[target] = dataclasses.replace(spec, shape=(2 * spec.shape[0], *spec.shape[1:]))
        elif target:
            out[target] = spec
    return out


def interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate row i at 2i, up row i at 2i + 1 (what vLLM's swigluoai splits back)."""
    return torch.stack([gate, up], dim=1).flatten(0, 1).contiguous()


def deinterleave(w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return w13[0::2].contiguous(), w13[1::2].contiguous()


class Interleaver:
    """Per-linear tensors in, streamed tensors out (:meth:`feed`): gate and up of one expert
    may arrive in either order and apart, so each waits until its pair is in."""

    def __init__(self) -> None:
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # w13 name -> part -> tensor

    def feed(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        target = streamed_name(name)
        if target is None:
            return [(name, tensor)]
        if not target:
            return []
        if ".w2_" in target:
            return [(target, tensor)]
        parts = self.pending.setdefault(target, {})
        parts[_PER_LINEAR.match(name)["part"]] = tensor
        if len(parts) < 2:
            return []
        del self.pending[target]
        return [(target, interleave(parts["gate_proj"], parts["up_proj"]))]


@dataclass(frozen=True)
class Alias:
    """A per-linear expert tensor answered from a streamed one: its rows ``rows`` of
    ``stored``; ``shape``: instead the module's ``weight_shape`` ``[rows, packed cols * 32 /
    bits]`` (computed, as the streamed form stores none)."""

    stored: str
    rows: slice
    shape: bool = False


def aliases(names: Iterable[str]) -> dict[str, Alias]:
    """Per-linear name -> :class:`Alias` for every streamed expert tensor in ``names``:
    what lets a reader of the per-linear form (llmctl's engine) read the streamed one."""
    out: dict[str, Alias] = {}
    for name in names:
        match = _STREAMED.match(name)
        if match is None:
            continue
        expert, tensor = match["expert"], match["tensor"]
        parts = ((("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2)))
                 if match["fused"] == "w13" else (("down_proj", slice(None)),))
        for part, rows in parts:
            module = f"{expert}.{part}"
            out[f"{module}.{tensor}"] = Alias(name, rows)
            if tensor == "weight_packed":
                out[f"{module}.weight_shape"] = Alias(name, rows, shape=True)
    return out


def is_streamed(name: str) -> bool:
    return _STREAMED.match(name) is not None


def read_alias(alias: Alias, get: Callable[[str], torch.Tensor], bits: int,
               stored_shape: Callable[[str], list[int]] | None = None) -> torch.Tensor:
    """The tensor ``alias`` stands for: ``get(name)`` reads a stored tensor; ``bits`` are
    the module's weight bits (for ``weight_shape``, computed from the stored shape, read
    with ``stored_shape(name)`` where given: the codes themselves are not needed)."""
    if not alias.shape:  # one owned, contiguous copy of the rows (get may view a memory map)
        return get(alias.stored)[alias.rows].clone(memory_format=torch.contiguous_format)
    shape = stored_shape(alias.stored) if stored_shape else get(alias.stored).shape
    rows = len(range(shape[0])[alias.rows])
    return torch.tensor([rows, shape[1] * 32 // bits], dtype=torch.int64)


def to_per_linear(tensors: dict[str, torch.Tensor], bits: int) -> dict[str, torch.Tensor]:
    """A whole state dict with streamed experts turned back into the per-linear form
    (with ``weight_shape``), other tensors as they are."""
    table = aliases(tensors)
    out = {k: v for k, v in tensors.items() if not is_streamed(k)}
    for name, alias in table.items():
        out[name] = read_alias(alias, tensors.__getitem__, bits)
    return out
