"""Every family llmctl runs, through the quantizer: the calibration forward against
transformers, the smoothing folds, and each method's checkpoint in transformers and in
llmctl's engine.

The models are the tiny random checkpoints of ``tests/data/families/`` (tests.tiny), each
with its family's features switched on (see tests/serve/model/test_families.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from llmctl.models.spec import ModelArch
from llmctl.quant import block
from llmctl.quant.checkpoint import Checkpoint
from llmctl.quant.stream import LayerStream
from tests.tiny import FAMILY_NAMES

# longer than every window (8, 16) and than Phi-3's LongRoPE switch (32)
SEQ = 40


def _ids(n: int = 2, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 500, (n, seq), generator=torch.Generator().manual_seed(seed))


def _layer_weights(ckpt: Checkpoint, i: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{i}."
    out = {}
    for name in ckpt.names():
        if name.startswith(prefix):
            key = name[len(prefix):]
            out[key.removesuffix(".weight") if key.endswith("norm.weight") else key] = \
                ckpt.get(name, torch.float32)
    return out


def stream_hidden_states(path, ids: torch.Tensor) -> list[torch.Tensor]:
    """The residual stream after every layer, as the quantizer's calibration pass computes
    it with float weights (embedding, then tap by tap through each layer)."""
    ckpt = Checkpoint(path)
    arch = ModelArch.from_config(ckpt.config)
    stream = LayerStream.for_model(arch, ids.shape[1], 1, torch.float32, "cpu")
    X = block.embed(ckpt.get("model.embed_tokens.weight", torch.float32), ids, arch)
    outs = []
    for i in range(arch.num_layers):
        stream.at(i)
        fw = stream.forward_weights(_layer_weights(ckpt, i))
        linear = stream.linear(fw, {})
        for tap in (*block.TAPS, "out"):
            stream.inputs(tap, X, fw, linear, None, advance=True)
        outs.append(X.clone())
    return outs


def hf_hidden_states(path, ids: torch.Tensor) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    outs: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.register_forward_hook(
            lambda m, a, out: outs.append((out[0] if isinstance(out, tuple) else out).clone()))
    with torch.inference_mode():
        model(ids)
    return outs


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_calibration_forward_equals_transformers_after_every_layer(tiny_family, name):
    """float32, 2 x 40 tokens: every layer's output within 1e-5 (relative to its scale)."""
    path = tiny_family(name)
    ids = _ids()
    got, want = stream_hidden_states(path, ids), hf_hidden_states(path, ids)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        err = ((g - w).abs().max() / w.abs().max()).item()
        assert err < 1e-5, f"{name} layer {i}: {err:.2e}"


# --- smoothing: where scales fold, and that folding is exact ---------------------------

# What AWQ smooths by default in a layer of each tiny model (all with GQA: 4 heads, 2 KV
# heads, so v -> o_proj is never folded); llm-compressor's AWQ registry is the reference
# (gemma3 leaves input_layernorm out; OLMo 2's post-norms fold nothing into q/k/v, gate/up)
AWQ_SMOOTHS = {
    "llama31": ["input_layernorm -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj",
                "post_attention_layernorm -> mlp.gate_proj, mlp.up_proj",
                "mlp.up_proj -> mlp.down_proj"],
    "granite": ["input_layernorm -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj",
                "post_attention_layernorm -> mlp.gate_proj, mlp.up_proj",
                "mlp.up_proj -> mlp.down_proj"],
    "gemma": ["input_layernorm -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj",
              "post_attention_layernorm -> mlp.gate_proj, mlp.up_proj",
              "mlp.up_proj -> mlp.down_proj"],
    "gemma2": ["input_layernorm -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj",
               "pre_feedforward_layernorm -> mlp.gate_proj, mlp.up_proj",
               "mlp.up_proj -> mlp.down_proj"],
    "gemma3": ["pre_feedforward_layernorm -> mlp.gate_proj, mlp.up_proj",
               "mlp.up_proj -> mlp.down_proj"],
    "olmo2": ["mlp.up_proj -> mlp.down_proj"],
    "phi3": ["input_layernorm -> self_attn.qkv_proj",
             "post_attention_layernorm -> mlp.gate_up_proj",
             "mlp.gate_up_proj (rows 128:256) -> mlp.down_proj"],
}


def _method(recipe: str):
    from llmctl.quant.methods import methods_for
    from llmctl.quant.recipe import load_recipe
    from tests.quant.conftest import RECIPES

    return methods_for(load_recipe(RECIPES / f"{recipe}.yaml")).smoother


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_what_awq_and_smoothquant_smooth_per_family(tiny_family, name):
    from llmctl.quant.smoothing import describe

    shape = block.BlockShape.from_arch(ModelArch.from_config(Checkpoint(tiny_family(name)).config))
    assert describe(_method("w4a16-awq"), shape) == AWQ_SMOOTHS[name]
    # SmoothQuant: the pre-norms only (llm-compressor's defaults, with Gemma 2/3's
    # pre_feedforward_layernorm where its registry names the post-attention norm)
    want = [line for line in AWQ_SMOOTHS[name] if "norm ->" in line]
    if name == "gemma3":
        want.insert(0, AWQ_SMOOTHS["gemma2"][0])
    assert describe(_method("w8a8-int8"), shape) == want


@pytest.fixture(scope="module")
def no_gqa(tmp_path_factory):
    """Tiny families with as many KV heads as query heads (v -> o_proj folds)."""

    from tests.tiny import FAMILY_CONFIGS, build_tiny_llama

    root = tmp_path_factory.mktemp("no-gqa")
    built = {}

    def make(name: str):
        if name not in built:
            config = json.loads((FAMILY_CONFIGS / f"{name}.json").read_text())
            config["num_key_value_heads"] = config["num_attention_heads"]
            built[name] = build_tiny_llama(root / name, layers=config.pop("num_hidden_layers"),
                                           **config)
        return built[name]

    return make


@pytest.mark.parametrize("name, gqa", [(n, True) for n in FAMILY_NAMES]
                         + [(n, False) for n in ("phi3", "gemma2", "olmo2")])
def test_every_fold_leaves_the_float_layer_unchanged(tiny_family, no_gqa, name, gqa):
    """Random scales in [0.25, 4] folded at every source the layout has (norms with
    Gemma's (1 + w), Phi-3's v rows of qkv_proj and up rows of gate_up_proj): the float32
    layer output moves by < 1e-5 of its scale, and the weights did change."""
    from llmctl.quant.smoothing import fold

    path = tiny_family(name) if gqa else no_gqa(name)
    ckpt = Checkpoint(path)
    arch = ModelArch.from_config(ckpt.config)
    model_shape = block.BlockShape.from_arch(arch)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, SEQ, arch.hidden_size, generator=gen) * 3
    for i in (0, 2):  # a sliding and a full layer where the family has both
        shape = model_shape.at(i)
        cos, sin = block.rotary_tables(arch, SEQ, torch.float32, local=shape.local_rope)
        weights = _layer_weights(ckpt, i)
        want = block.forward(x, weights, block.float_linear(weights), shape, cos, sin)
        folded = dict(weights)
        taps = [t for t in block.TAPS if shape.source(t) is not None
                and (shape.source(t).norm or _rows(shape, t) == shape.tap_dim(t))]
        for tap in taps:
            scales = 4 ** (2 * torch.rand(shape.tap_dim(tap), generator=gen) - 1)
            fold(folded, shape, tap, list(shape.linears[tap]), scales)
        got = block.forward(x, folded, block.float_linear(folded), shape, cos, sin)
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5, (name, i)
        assert len(taps) == (4 if not gqa else 3) - (2 if shape.layout == "post" else 0)
        assert all(not torch.equal(folded[k], weights[k]) for k in weights
                   if k.endswith("proj.weight") and any(k.startswith(t) for tap in taps
                                                        for t in shape.linears[tap]))


def _rows(shape: block.BlockShape, tap: str) -> int:
    source = shape.source(tap)
    if source.rows is not None:
        return source.rows.stop - source.rows.start
    return {"self_attn.v_proj": shape.kv_heads * shape.head_dim,
            "mlp.up_proj": shape.intermediate}[source.module]


# --- every method on every family: compressed-tensors in transformers and in the engine --

# One recipe per method, each with the scheme it is known for. The shipped recipes where
# they are quick; FP8 and SmoothQuant's int8 with round-to-nearest weights (data-free
# FP8; SmoothQuant still calibrates) and AWQ on a 5-point grid: fast enough to run every
# family (GPTQ with FP8 / int8 weights is the shipped w8a8 recipes', covered on Llama
# in test_pipeline.py).
TEST_RECIPES = {
    "fp8-rtn": """
quant_stage:
  quant_modifiers:
    QuantizationModifier: {scheme: FP8_DYNAMIC, targets: [Linear], ignore: [lm_head]}
""",
    "int8-smoothquant": """
quant_stage:
  quant_modifiers:
    SmoothQuantModifier: {smoothing_strength: 0.8}
    QuantizationModifier: {scheme: W8A8, targets: [Linear], ignore: [lm_head]}
""",
    "w4a16-awq-grid5": """
quant_stage:
  quant_modifiers:
    AWQModifier: {scheme: W4A16, targets: [Linear], ignore: [lm_head], n_grid: 5}
""",
}
METHODS = ("w4a16-rtn", "w4a16-gptq", "w4a16-awq-grid5", "fp8-rtn", "int8-smoothquant")
# ||logits - float logits|| / ||float logits|| on 2 x 40 tokens; measured on these random
# tiny models (far harder to quantize than trained ones; Llama 3.1's the hardest) with
# 4 x 40 calibration tokens: see the report in the commit message
REL_BOUND = {"w4a16-rtn": 0.8, "w4a16-gptq": 0.8, "w4a16-awq-grid5": 0.8,
             "fp8-rtn": 0.3, "int8-smoothquant": 0.15}
# Which family runs which method in the suite (35 quantizations took ~6 min of CI): RTN on
# every family (the block forward and the writer per family), the calibrated methods on
# the layouts where they differ: Phi-3's fused projections, Gemma 2's sandwich norms,
# OLMo 2's post-norms (nothing to fold into), Gemma 3's q/k norms and local RoPE, Granite's
# multipliers. Every pair ran once in development (the table in the commit message).
CASES = ([(name, "w4a16-rtn") for name in FAMILY_NAMES]
         + [(n, "w4a16-gptq") for n in ("phi3", "gemma2", "olmo2")]
         + [(n, "w4a16-awq-grid5") for n in ("phi3", "gemma2", "gemma3", "olmo2")]
         + [(n, "fp8-rtn") for n in ("granite", "gemma3")]
         + [(n, "int8-smoothquant") for n in ("phi3", "gemma2", "olmo2")])
ENGINE_CASES = [("phi3", "w4a16-gptq"), ("gemma2", "w4a16-gptq"), ("gemma3", "fp8-rtn"),
                ("olmo2", "int8-smoothquant")]


@pytest.fixture(scope="session")
def quantized_family(tiny_family, tmp_path_factory):
    """(family, recipe) -> the quantized output directory, built once per session
    (4 x 40 calibration tokens: past every window and Phi-3's LongRoPE switch)."""
    from tests.quant.conftest import RECIPES, run_quantize

    root = tmp_path_factory.mktemp("quantized-families")
    built = {}

    def get(name: str, recipe: str):
        if (name, recipe) not in built:
            out = root / f"{name}-{recipe}"
            if recipe in TEST_RECIPES:
                file = root / f"{recipe}.yaml"
                file.write_text(TEST_RECIPES[recipe])
            else:
                file = RECIPES / f"{recipe}.yaml"
            run_quantize(tiny_family(name), file, out, samples=4, seq_len=SEQ)
            built[name, recipe] = out
        return built[name, recipe]

    return get


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids).logits.float()


@pytest.mark.parametrize("name, recipe", CASES)
def test_method_checkpoint_loads_in_transformers(tiny_family, quantized_family, name, recipe):
    """transformers (with compressed-tensors) loads every tensor, computes what llmctl's
    own decoding of the checkpoint computes (1e-4), and is near the float model."""
    from transformers import AutoModelForCausalLM

    from llmctl.quant.reference import load_reference

    out = quantized_family(name, recipe)
    model, info = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = _ids(seed=1)
    got = _logits(model.eval(), ids)
    torch.testing.assert_close(got, _logits(load_reference(out), ids), atol=1e-4, rtol=1e-4)
    base = _logits(AutoModelForCausalLM.from_pretrained(str(tiny_family(name)),
                                                        dtype=torch.float32).eval(), ids)
    rel = ((got - base).norm() / base.norm()).item()
    assert 0 < rel < REL_BOUND[recipe], rel


def _weights_only_reference(out):
    """llmctl's float model of a checkpoint, weights dequantized, activations left in
    float (the engine runs weight-only: it does not quantize activations)."""
    from llmctl.quant.reference import load_reference

    model = load_reference(out)
    for module in model.modules():
        module._forward_pre_hooks.clear()
    return model


@pytest.mark.parametrize("name, recipe", ENGINE_CASES)
def test_the_engine_serves_each_family_s_checkpoint(quantized_family, name, recipe):
    """llmctl's engine on the checkpoint, float32 on dequantized weights: a 7-token
    prefill then one token at a time, within 2e-4 of the dequantized transformers model
    (W8A8 int8 and FP8: the weights; the engine does not quantize activations); W4A16
    also on the int4 kernels (bf16 activations: 0.25, as for Llama)."""
    from llmctl.serve.engine.llm import LLM
    from llmctl.serve.model.scoring import teacher_forced_logits

    out = quantized_family(name, recipe)
    ids = _ids(1, 48, seed=2)[0].tolist()
    want = _logits(_weights_only_reference(out), torch.tensor([ids]))[0, 6:]
    llm = LLM(str(out), quant_backend="dequantize", kv_cache_memory="4MiB", block_size=4)
    got = teacher_forced_logits(llm.engine, ids, 7)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    if recipe == "w4a16-gptq":
        llm = LLM(str(out), kv_cache_memory="4MiB", block_size=4)
        torch.testing.assert_close(teacher_forced_logits(llm.engine, ids, 7), want,
                                   atol=0.25, rtol=0.02)


def test_fused_split_slices_group_quantized_codes(tiny_family, tmp_path):
    """Phi-3's qkv_proj and gate_up_proj, asymmetric int4 in groups of 16, read by the
    engine as q/k/v and gate/up: each part's codes, scales and zero points dequantize to
    exactly its rows of the whole (decoded by llmctl's compressed-tensors reader)."""

    from llmctl.models.spec import FAMILIES
    from llmctl.quant.reference import _tensors, decode_weight
    from llmctl.serve.model.decoder import ModelSpec
    from llmctl.serve.model.weights import CheckpointReader, FusedSplit
    from tests.quant.conftest import run_quantize, write_recipe

    recipe = write_recipe(tmp_path / "asym.yaml", """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 4, type: int, symmetric: false, strategy: group, group_size: 16}
""")
    out = tmp_path / "out"
    run_quantize(tiny_family("phi3"), recipe, out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = qc["config_groups"]["group_0"]
    assert scheme["format"] == "pack-quantized"
    spec = ModelSpec.from_dir(out)
    family = FAMILIES["phi3"]
    split = FusedSplit(CheckpointReader(out, qc), spec, family.fused_parts,
                       {f: ModelArch.part_rows(spec, f) for f in family.fused})
    tensors = _tensors(out)
    for whole, parts in family.fused_parts.items():
        name = f"model.layers.1.{whole}"
        full = decode_weight(name, tensors, scheme, "pack-quantized")
        start = 0
        for part, rows in zip(parts, ModelArch.part_rows(spec, whole)):
            w = split.layer_weight(f"model.layers.1.{part}")
            assert w.zero_point is not None and w.group_size == 16
            assert torch.equal(w.dequantize(torch.float32), full[start:start + rows])
            start += rows
        assert start == full.shape[0]


@pytest.mark.parametrize("name", ["gemma2", "olmo2"])
def test_the_dry_run_says_what_awq_smooths(tiny_family, name):
    from typer.testing import CliRunner

    from llmctl.cli.app import build_app

    args = ["quantize", str(tiny_family(name)), "-r", "w4a16-awq", "--dry-run"]
    result = CliRunner().invoke(build_app(), args)
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "smoothing folds, in every layer: " + "; ".join(AWQ_SMOOTHS[name]) in text
    data = CliRunner().invoke(build_app(), [*args, "--json"])
    assert json.loads(data.stdout)["plan"]["smoothing"] == AWQ_SMOOTHS[name]
