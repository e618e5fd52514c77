"""gpt-oss's fused experts as the per-expert linears the quantizer reads and writes.

gpt-oss stores each layer's experts as two 3-D tensors computing ``x @ W``, with biases
(``spec.MoeLayout.gpt_oss_experts``)::

    mlp.experts.gate_up_proj [E, H, 2I]   gate = columns ::2, up = columns 1::2
    mlp.experts.gate_up_proj_bias [E, 2I]
    mlp.experts.down_proj [E, I, H],  mlp.experts.down_proj_bias [E, H]

or the two weights as MXFP4 ``{name}_blocks [E, out, in / 32, 16]`` / ``{name}_scales``
(:mod:`llmctl.quant.mxfp4`, already the ``F.linear`` layout ``[E, out, in]`` once decoded).
The quantizer sees instead the names llm-compressor's gpt-oss linearization gives them
(its ``GptOssExpert``: ``gate_proj.weight = gate_up_proj[e][:, ::2].T`` with the bias's
even columns, ``up_proj`` the odd ones, ``down_proj.weight = down_proj[e].T``), the names
vLLM matches a config's groups against (``experts.0.gate_proj``)::

    mlp.experts.{e}.gate_proj.weight [I, H]  .bias [I]
    mlp.experts.{e}.up_proj.weight   [I, H]  .bias [I]
    mlp.experts.{e}.down_proj.weight [H, I]  .bias [H]

so planning, statistics, quantization and writing run as for Qwen3-MoE's per-expert
experts. (vLLM's gpt-oss loader does not read these tensor names: symmetric WNA16 experts
are written in its streamed form instead, :mod:`llmctl.quant.vllm_gpt_oss`.) The views'
dtype is the stored float dtype (MXFP4: the biases' dtype, the form transformers decodes
to); their bytes are of that float form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl.models.spec import FAMILIES, MoeLayout
from llmctl.quant import mxfp4

# per expert linear (MoeLayout.experts: gate, up, down): which fused tensor
# (MoeLayout.fused: gate_up, down) and which of its rows in the ``[E, out, in]`` layout
_PARTS = ((0, slice(0, None, 2)), (0, slice(1, None, 2)), (1, slice(None)))


@dataclass(frozen=True)
class ExpertView:
    """One per-expert tensor: rows ``rows`` of expert ``expert`` of a fused tensor."""

    fused: str  # the fused weight's name (without _blocks), e.g. model.layers.0.mlp.experts.down_proj
    expert: int
    rows: slice
    bias: bool
    shape: tuple[int, ...]
    dtype: torch.dtype


def layout_of(config: dict) -> MoeLayout | None:
    """The MoE layout whose experts are stored fused this way (gpt-oss), else None."""
    row = FAMILIES.get(config.get("model_type", ""))
    moe = None if row is None else row.moe
    return moe if moe is not None and moe.gpt_oss_experts else None


def expert_views(meta: dict[str, dict], dtype_of, layout: MoeLayout
                 ) -> tuple[dict[str, ExpertView], set[str]]:
    """(per-expert name -> view, the stored names they replace), from the checkpoint's
    headers (``meta``: name -> safetensors entry; ``dtype_of(name)``)."""
    views: dict[str, ExpertView] = {}
    order: dict[str, tuple] = {}  # (layer, expert, gate/up/down, bias): the file order
    replaced: set[str] = set()
    for name in meta:
        for which, stored in enumerate(layout.fused):
            prefix, sep, rest = name.partition(stored)
            if not sep or rest not in ("", "_blocks") or not prefix.startswith("model.layers."):
                continue
            full = prefix + stored
            bias = f"{full}_bias"
            blocks = rest == "_blocks"
            replaced.update({name, bias} | ({f"{full}_scales"} if blocks else set()))
            shape = meta[name]["shape"]  # float: [E, in, out]; MXFP4: [E, out, in / 32, 16]
            experts, out, inp = (shape[0], shape[1], shape[2] * 2 * shape[3]) if blocks \
                else (shape[0], shape[2], shape[1])
            dtype = dtype_of(bias) if blocks else dtype_of(name)
            for part, (pattern, (index, rows)) in enumerate(zip(layout.experts, _PARTS)):
                if index != which:
                    continue
                n = len(range(out)[rows])
                module = prefix + pattern
                for e in range(experts):
                    base = module.format(e=e)
                    views[f"{base}.weight"] = ExpertView(full, e, rows, False, (n, inp), dtype)
                    views[f"{base}.bias"] = ExpertView(full, e, rows, True, (n,),
                                                       dtype_of(bias))
                    layer = int(prefix.split(".")[2])
                    order[f"{base}.weight"] = (layer, e, part, 0)
                    order[f"{base}.bias"] = (layer, e, part, 1)
    return {k: views[k] for k in sorted(views, key=order.__getitem__)}, replaced


def decode(get, has, fused: str, dtype: torch.dtype) -> torch.Tensor:
    """A fused expert weight in the ``F.linear`` layout ``[E, out, in]`` (``get(name)``
    reads a stored tensor): MXFP4 decoded as transformers decodes it, a float ``x @ W``
    tensor transposed."""
    if has(f"{fused}_blocks"):
        return mxfp4.dequantize(get(f"{fused}_blocks"), get(f"{fused}_scales"), dtype)
    return get(fused).transpose(1, 2)


def read(view: ExpertView, fused: torch.Tensor | None, bias: torch.Tensor | None
         ) -> torch.Tensor:
    """The tensor of ``view``: its rows of the decoded fused weight, or of the stored bias."""
    return (bias if view.bias else fused)[view.expert, view.rows].contiguous()
