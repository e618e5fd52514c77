"""Resolve a recipe against a checkpoint: the scheme of every linear, before running.

Matching follows compressed-tensors (and so transformers and vLLM, which load the
output): a module's targets are tried exact name first, then ``re:`` regexes (in sorted
order), then class names (``Linear``); the first match wins, and ``ignore`` (same
syntax) removes a module. Group sizes must divide a layer's input features; the valid
sizes are the powers of two from 16 up that do (what GPU kernels accept). Unless
``strict`` is set, a layer whose requested size does not divide gets the largest valid
size below it; either way the dry run shows it.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field
from typing import Any

from llmctl.errors import ConfigError, UsageError
from llmctl.models.spec import ModelArch
from llmctl.quant import vllm_gpt_oss
from llmctl.quant.checkpoint import Checkpoint
from llmctl.quant.recipe import Recipe
from llmctl.quant.rtn import IntGrid
from llmctl.utils.dtypes import dtype_name, float_bytes

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")
# every family's linears (Phi-3 stores q/k/v and gate/up fused: qkv_proj, gate_up_proj)
_LINEAR_KINDS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                 "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                 "mlp.gate_up_proj", "mlp.down_proj")
# a mixture of experts' linears, as on disk: each expert's gate/up/down (Mixtral's
# w1/w3/w2) and Qwen2-MoE's shared expert, each its own quantization target
_EXPERT_KIND = re.compile(r"^(mlp|block_sparse_moe)\.(experts\.\d+\.(gate_proj|up_proj|down_proj"
                          r"|w1|w2|w3)|shared_expert\.(gate_proj|up_proj|down_proj))$")
# Kept in full precision whatever the recipe says, and named in the output's ``ignore``:
# vLLM builds the router (mlp.gate / block_sparse_moe.gate / gpt-oss's mlp.router) and
# Qwen2-MoE's shared-expert sigmoid gate unquantized, and a quantized router's moved
# logits reroute tokens.
ROUTER_KINDS = ("mlp.gate", "block_sparse_moe.gate", "mlp.router", "mlp.shared_expert_gate")
ROUTER_NOTE = "router: full precision (vLLM expects it unquantized)"
MIN_GROUP = 16


@dataclass(frozen=True)
class WeightSpec:
    type: str  # "int" | "float"
    bits: int
    symmetric: bool
    strategy: str  # "tensor" | "channel" | "group"
    group_size: int | None  # the effective group size (groups only)
    observer: str = "minmax"
    actorder: str | None = None

    @property
    def grid(self) -> IntGrid:
        size = {"tensor": None, "channel": -1}.get(self.strategy, self.group_size)
        return IntGrid(self.bits, self.symmetric, size)

    def label(self) -> str:
        kind = "fp8" if self.type == "float" else f"int{self.bits}"
        where = {"tensor": "tensor", "channel": "channel"}.get(self.strategy, f"g{self.group_size}")
        sym = "" if self.type == "float" else (" sym" if self.symmetric else " asym")
        return f"{kind}{sym} {where}"


@dataclass(frozen=True)
class ActSpec:
    type: str
    bits: int
    symmetric: bool
    strategy: str  # "token" | "tensor"
    dynamic: bool

    def label(self) -> str:
        kind = "fp8" if self.type == "float" else f"int{self.bits}"
        how = "dynamic" if self.dynamic else "static"
        return f"{kind} {how} per-{self.strategy}"


@dataclass
class ModulePlan:
    name: str
    layer: int | None  # None: lm_head
    kind: str
    in_features: int
    out_features: int
    group: str | None = None  # output config group; None = kept in float
    weight: WeightSpec | None = None
    act: ActSpec | None = None
    format: str = "dense"
    note: str = ""
    bytes_before: int = 0
    bytes_after: int = 0
    scheme: Any = None  # compressed-tensors QuantizationScheme (effective)

    @property
    def quantized(self) -> bool:
        return self.weight is not None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": [self.out_features, self.in_features],
                "group": self.group, "weight": self.weight.label() if self.weight else None,
                "activations": self.act.label() if self.act else None, "format": self.format,
                "note": self.note, "bytes_before": self.bytes_before,
                "bytes_after": self.bytes_after}


@dataclass
class QuantPlan:
    method: str
    modules: list[ModulePlan]
    groups: dict[str, Any]  # output config_groups: name -> QuantizationScheme
    ignore: list[str]
    format: str
    bytes_before: int
    bytes_after: int
    dtype: str
    warnings: list[str] = field(default_factory=list)
    # static FP8 K/V scales to calibrate and write (compressed-tensors QuantizationArgs)
    kv_cache_scheme: Any = None
    # what the smoothing method folds in each layer ("source -> linears"), per the model's
    # norm layout (llmctl.quant.smoothing.describe); None: the recipe smooths nothing
    smoothing: list[str] | None = None

    @property
    def kv_per_head(self) -> bool:
        return getattr(self.kv_cache_scheme.strategy, "value", self.kv_cache_scheme.strategy) \
            == "attn_head"

    @property
    def quantized(self) -> list[ModulePlan]:
        return [m for m in self.modules if m.quantized]

    def module(self, name: str) -> ModulePlan | None:
        return next((m for m in self.modules if m.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "format": self.format, "dtype": self.dtype,
                "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
                "modules": [m.to_dict() for m in self.modules], "warnings": self.warnings,
                "ignore": self.ignore,
                "config_groups": {k: v.model_dump(mode="json") for k, v in self.groups.items()},
                "kv_cache_scheme": (None if self.kv_cache_scheme is None
                                    else self.kv_cache_scheme.model_dump(mode="json")),
                "smoothing": self.smoothing}


# --- matching (compressed-tensors' precedence) -------------------------------------------

def name_matches(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _matches(name: str, target: str, cls: str) -> bool:
    return name_matches(name, target) or target == cls


def resolve_target(name: str, cls: str, groups: dict[str, Any]) -> str | None:
    """The config group a module falls in, or None."""
    target_to_group: dict[str, str] = {}
    for gname, scheme in groups.items():
        for target in scheme.targets:
            target_to_group[target] = gname  # a later group wins a repeated target
    ordered = sorted(target_to_group, key=lambda t: ("re:" in t, t))
    for target in ordered:
        if name_matches(name, target):
            return target_to_group[target]
    for target in ordered:
        if target == cls:
            return target_to_group[target]
    return None


def valid_group_sizes(in_features: int) -> list[int]:
    sizes, g = [], MIN_GROUP
    while g <= in_features:
        if in_features % g == 0:
            sizes.append(g)
        g *= 2
    return sizes


def effective_group_size(name: str, in_features: int, requested: int, strict: bool) -> int:
    if in_features % requested == 0:
        return requested
    valid = valid_group_sizes(in_features)
    below = [g for g in valid if g <= requested]
    if strict or not below:
        raise ConfigError(
            f"group size {requested} does not divide {name}'s {in_features} input features",
            f"valid group sizes for it: {', '.join(map(str, valid)) or 'none'}"
            + ("" if strict else f" (none at or below {requested})")
            + "; set group_size accordingly" + (", or drop --strict-group-size" if strict else ""))
    return below[-1]


# --- schemes -> specs ---------------------------------------------------------------------

def _weight_spec(args, actorder_default: str | None) -> WeightSpec:
    strategy = str(args.strategy)
    if strategy not in ("tensor", "channel", "group"):
        raise ConfigError(f"weight strategy {strategy!r} is not supported",
                          "use tensor, channel or group")
    kind = str(args.type)
    if kind == "float" and args.num_bits != 8:
        raise ConfigError(f"float weights of {args.num_bits} bits are not supported", "use FP8 (8 bits)")
    if kind == "float" and strategy == "group":
        raise ConfigError("FP8 weights per group are not supported", "use tensor or channel")
    if kind == "int" and not 2 <= args.num_bits <= 8:
        raise ConfigError(f"int{args.num_bits} weights are not supported", "use 2 to 8 bits")
    actorder = args.actorder if args.actorder is not None else actorder_default
    actorder = {"weight": "static", "dynamic": "group"}.get(actorder, actorder)
    if actorder == "group":
        raise ConfigError("actorder: group needs a g_idx tensor, which compressed-tensors "
                          ">= 0.20 no longer stores",
                          "use actorder: static (same kernels, no g_idx)")
    return WeightSpec(kind, args.num_bits, bool(args.symmetric) or kind == "float", strategy,
                      args.group_size if strategy == "group" else None,
                      args.observer or "minmax", actorder)


def _act_spec(args) -> ActSpec | None:
    if args is None:
        return None
    strategy = str(args.strategy)
    if strategy not in ("token", "tensor"):
        raise ConfigError(f"activation strategy {strategy!r} is not supported",
                          "use token (dynamic) or tensor (static or dynamic)")
    if args.num_bits != 8:
        raise ConfigError(f"{args.num_bits}-bit activations are not supported", "use 8-bit activations")
    return ActSpec(str(args.type), args.num_bits, bool(args.symmetric), strategy, bool(args.dynamic))


def _linears(ckpt: Checkpoint) -> list[tuple[str, int | None, str, int, int]]:
    found = []
    for name in ckpt.names():
        m = _LAYER.match(name)
        if m and (m.group(2) in _LINEAR_KINDS or m.group(2) in ROUTER_KINDS
                  or _EXPERT_KIND.match(m.group(2))):
            out, inp = ckpt.shape(name)
            found.append((name[: -len(".weight")], int(m.group(1)), m.group(2), inp, out))
    if ckpt.has("lm_head.weight"):
        out, inp = ckpt.shape("lm_head.weight")
        found.append(("lm_head", None, "lm_head", inp, out))
    order = {k: i for i, k in enumerate(_LINEAR_KINDS)}
    return sorted(found, key=lambda f: (f[1] if f[1] is not None else 1 << 30, order.get(f[2], 99)))


def _packed_bytes(m: ModulePlan, dtype_bytes: int) -> int:
    w, rows, cols = m.weight, m.out_features, m.in_features
    n_scales = {"tensor": 1, "channel": rows}.get(w.strategy, rows * (cols // (w.group_size or cols)))
    total = n_scales * dtype_bytes
    if m.format == "pack-quantized":
        total += rows * math.ceil(cols * w.bits / 32) * 4 + 16
        if not w.symmetric:
            total += math.ceil(rows * w.bits / 32) * 4 * max(n_scales // rows, 1)
    else:
        total += rows * cols  # one byte per int8 / fp8 code
        if not w.symmetric:
            total += n_scales
    if m.act is not None and not m.act.dynamic:
        total += dtype_bytes * (1 if m.act.symmetric else 2)
    return total


def build_plan(ckpt: Checkpoint, recipe: Recipe, *, strict_group_size: bool = False) -> QuantPlan:
    from compressed_tensors.compressors.format import infer_module_format
    from torch import nn

    modifier = recipe.weight_modifier
    groups = modifier.resolved_groups()
    actorder_default = getattr(modifier, "actorder", None)
    dtype = dtype_name(ckpt.weight_dtype)
    dtype_bytes = float_bytes(dtype)
    tied = bool(ckpt.text_config.get("tie_word_embeddings", ckpt.config.get("tie_word_embeddings")))
    warnings: list[str] = []
    modules: list[ModulePlan] = []
    for name, layer, kind, inp, out in _linears(ckpt):
        plan = ModulePlan(name, layer, kind, inp, out,
                          bytes_before=ckpt.nbytes(f"{name}.weight"))
        plan.bytes_after = plan.bytes_before
        modules.append(plan)
        if kind in ROUTER_KINDS:
            plan.note = ROUTER_NOTE
            continue
        if any(_matches(name, ign, "Linear") for ign in modifier.ignore):
            continue
        gname = resolve_target(name, "Linear", groups)
        if gname is None or groups[gname].weights is None:
            continue
        scheme = groups[gname]
        spec = _weight_spec(scheme.weights, actorder_default)
        if spec.strategy == "group":
            eff = effective_group_size(name, inp, spec.group_size, strict_group_size)
            if eff != spec.group_size:
                plan.note = f"group {spec.group_size} -> {eff}"
                spec = WeightSpec(spec.type, spec.bits, spec.symmetric, spec.strategy, eff,
                                  spec.observer, spec.actorder)
        plan.weight = spec
        plan.act = _act_spec(scheme.input_activations)
        if scheme.output_activations is not None:
            raise ConfigError(f"config group {gname!r} quantizes output activations",
                              "remove output_activations: only weights and inputs are supported")
        plan.group = gname if spec.group_size == scheme.weights.group_size else f"{gname}_g{spec.group_size}"
        eff_args = scheme.weights.model_copy(update={"group_size": spec.group_size}) \
            if spec.strategy == "group" else scheme.weights
        plan.scheme = scheme.model_copy(update={"weights": eff_args})
        plan.format = str(getattr(infer_module_format(nn.Linear, plan.scheme), "value",
                                  infer_module_format(nn.Linear, plan.scheme)))
        plan.bytes_after = _packed_bytes(plan, dtype_bytes)
    if tied and any(name_matches("lm_head", t) or t == "Linear" for g in groups.values()
                    for t in g.targets) and not any(name_matches("lm_head", i) for i in modifier.ignore):
        warnings.append("lm_head is tied to the embeddings and stays in float")
    check_patterns([m.name for m in modules], groups, modifier.ignore)
    if not any(m.quantized for m in modules):
        raise ConfigError("the recipe's targets match no linear layer of this model",
                          "check `targets` / `ignore` (module names look like "
                          "model.layers.0.self_attn.q_proj)")
    warnings += _layout_warnings(modules, groups, bool(ckpt.views))
    out_groups = _output_groups(groups, modules)
    # Every Linear the loader would match but llmctl kept in float must be ignored by
    # name, or transformers / vLLM would expect quantized tensors for it; the routers
    # always are (ROUTER_KINDS).
    ignore = list(modifier.ignore) + [m.name for m in modules if m.kind in ROUTER_KINDS
                                      and not any(name_matches(m.name, i) for i in modifier.ignore)]
    candidates = [m.name for m in modules if not m.quantized] + (["lm_head"] if tied else [])
    for name in candidates:
        if not any(_matches(name, i, "Linear") for i in ignore) and \
                resolve_target(name, "Linear", out_groups) is not None:
            ignore.append(name)
    formats = {m.format for m in modules if m.quantized}
    fmt = formats.pop() if len(formats) == 1 else "mixed-precision"
    linear_bytes = {f"{m.name}.weight": (m.bytes_before, m.bytes_after) for m in modules}
    before = sum(ckpt.nbytes(n) for n in ckpt.names())
    after = before - sum(b - a for b, a in linear_bytes.values())
    kv = modifier.kv_cache_scheme
    if kv is not None:  # one float32 scale (or one per KV head) for K and V of each layer
        per_layer = 2 * 4 * (kv_heads(ckpt) if getattr(kv.strategy, "value", kv.strategy)
                             == "attn_head" else 1)
        after += per_layer * int(ckpt.text_config.get("num_hidden_layers",
                                                      ckpt.config.get("num_hidden_layers", 0)))
    return QuantPlan(recipe.method, modules, out_groups, ignore, fmt, before,
                     after, dtype, warnings, kv_cache_scheme=kv)


def _layout_warnings(modules: list[ModulePlan], groups: dict[str, Any],
                     split_experts: bool = False) -> list[str]:
    """What the dry run should tell about the planned layout: loaders that will not read
    it, group sizes changed, routers a target named, experts split across groups.
    ``split_experts``: fused experts written one linear each (gpt-oss, ``fused_experts``)."""
    warnings = []
    if split_experts:
        warnings.append(_gpt_oss_experts_warning(modules))
    if any(m.format == "pack-quantized" and not m.weight.symmetric for m in modules if m.quantized):
        warnings.append("asymmetric pack-quantized weights load in vLLM and in llmctl, but not "
                        "in transformers 5.x with compressed-tensors 0.20 (packed zero points; "
                        "llm-compressor issue #1618): use symmetric weights for transformers")
    adjusted = sorted({m.note for m in modules if m.note and m.kind not in ROUTER_KINDS})
    if adjusted:
        warnings.append("group size changed where it does not divide the input features: "
                        + "; ".join(f"{sum(1 for m in modules if m.note == a)} layers {a}"
                                    for a in adjusted))
    for m in modules:
        if m.kind in ROUTER_KINDS and any(name_matches(m.name, t) for g in groups.values()
                                          for t in g.targets):
            warnings.append(f"{m.name} is a router: it stays in full precision")
    expert_groups = {m.group for m in modules if m.quantized and _EXPERT_KIND.match(m.kind)}
    if len(expert_groups) > 1 or any(g and "_g" in g for g in expert_groups):
        warnings.append("the experts' linears fall in several config groups (group sizes "
                        "changed): vLLM refuses such a mixture (one scheme per fused expert "
                        "layer) and transformers 5 decodes its fused experts with one group's "
                        "scheme; use a group size that divides every expert's width")
    return warnings


def _gpt_oss_experts_warning(modules: list[ModulePlan]) -> str:
    """Which form gpt-oss's quantized experts are written in, and who loads it: vLLM 0.32
    reads only the streamed WNA16 form, transformers 5 neither (it wants the fused
    gate_up_proj / down_proj, which llmctl does not write quantized)."""
    if vllm_gpt_oss.streamed(modules):
        return (f"gpt-oss's experts are written in {vllm_gpt_oss.FORM}: vLLM 0.32 and llmctl "
                "load them; transformers 5 does not (it expects the fused gate_up_proj / "
                "down_proj)")
    return (f"gpt-oss's experts are written {vllm_gpt_oss.PER_LINEAR_FORM}: llmctl serves "
            "them; vLLM 0.32 does not load them (it reads gpt-oss's quantized experts only "
            "as symmetric int4/int8 weight-only, WNA16, in its streamed per-expert form) and "
            "transformers 5 neither (it expects the fused gate_up_proj / down_proj)")


class UnmatchedPatternError(ConfigError):
    """A recipe's ``targets`` / ``ignore`` entry that matches no module: the recipe is
    wrong for this model (exit code 2, as a usage error)."""

    exit_code = UsageError.exit_code


def check_patterns(names: list[str], groups: dict[str, Any], ignore: list[str]) -> None:
    """Every ``targets`` / ``ignore`` entry that names modules (not a class such as
    ``Linear``) must match one: a pattern that matches nothing is a typo or another
    model's name (an expert's ``w1`` on a Qwen-MoE), which would silently quantize more
    or less than meant. The error names the closest module names (difflib)."""
    known = names + ["lm_head"]  # lm_head is a module even where tied to the embeddings
    entries = [("targets", t) for g in groups.values() for t in g.targets] + \
        [("ignore", i) for i in ignore]
    for where, entry in entries:
        if _is_class_name(entry) or any(name_matches(n, entry) for n in known):
            continue
        # one name per module kind (layer 0's), so the suggestions are distinct kinds
        kinds = sorted({re.sub(r"\.experts\.\d+\.", ".experts.0.",
                               re.sub(r"^model\.layers\.\d+\.", "model.layers.0.", n))
                        for n in known})
        close = difflib.get_close_matches(entry.removeprefix("re:"), kinds, n=3, cutoff=0.0)
        raise UnmatchedPatternError(f"recipe {where} entry {entry!r} would match no linear "
                                    f"layer of this model (closest: {', '.join(close)})")


def _is_class_name(entry: str) -> bool:
    return not entry.startswith("re:") and "." not in entry and entry[:1].isupper()


def kv_heads(ckpt: Checkpoint) -> int:
    return ModelArch.from_config(ckpt.config).num_kv_heads


def _output_groups(groups: dict[str, Any], modules: list[ModulePlan]) -> dict[str, Any]:
    """The recipe's groups as written, except that a group whose group size had to change
    for some layers is split into groups that name their modules exactly (a broad target
    next to exact ones makes loaders warn, as they try targets in file order)."""
    out: dict[str, Any] = {}
    for gname, scheme in groups.items():
        subs = sorted({m.group for m in modules if m.group and m.group.startswith(f"{gname}_g")})
        parts = ([gname] if any(m.group == gname for m in modules) else []) + subs
        if not subs:
            members = [m for m in modules if m.group == gname]
            out[gname] = scheme.model_copy(update={"format": members[0].format}) if members else scheme
            continue
        for part in parts:
            members = [m for m in modules if m.group == part]
            out[part] = members[0].scheme.model_copy(
                update={"targets": [m.name for m in members], "format": members[0].format})
    return out
