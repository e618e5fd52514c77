"""``llmctl quantize`` on gpt-oss, per expert: the block forward against transformers (float
and MXFP4 experts), the fused experts read as llm-compressor's linearization names them,
every method with its per-expert report, and the checkpoint in llmctl's engine against
transformers on the dequantized weights (the W4A16 experts written in vLLM's streamed form
are read back per linear: ``vllm_gpt_oss.to_per_linear``; test_gpt_oss_vllm_form.py checks
that form itself).

The model is the tiny random gpt-oss of ``tests/data/families/gpt_oss.json`` (3 layers,
sliding/full/sliding with a window of 8, 4 heads over 2 KV heads with q/k/v/o biases and
sinks, 4 experts top-2 with biases and the clamped SwiGLU at limit 1.5, YaRN RoPE). Its
experts are 32 wide: the recipes quantize in groups of 16 (``test_moe_quant.RECIPES``).
vLLM loading cannot be tested here (no vLLM in this environment): see
benchmarks/gpt_oss_quant_in_vllm.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmctl.quant import vllm_gpt_oss
from llmctl.quant.checkpoint import Checkpoint
from tests.quant.conftest import run_quantize, write_recipe
from tests.quant.test_families import _ids, hf_hidden_states, stream_hidden_states
from tests.quant.test_moe_quant import RECIPES, SEQ, _cli, _hf, _tensors, starve_expert_0  # noqa: F401
from tests.serve.model.test_gpt_oss import _mxfp4_checkpoint

NAME = "gpt_oss"
PARTS = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def mxfp4_model(tiny_family, tmp_path_factory):
    """(the tiny gpt-oss with MXFP4 experts, its blocks and scales by fused name)."""
    out = tmp_path_factory.mktemp("gpt-oss-mxfp4") / "model"
    return out, _mxfp4_checkpoint(tiny_family(NAME), out)


@pytest.fixture(scope="module")
def quantized(tiny_family, tmp_path_factory):
    """recipe -> (output dir, report) of the float tiny gpt-oss, built once."""
    root = tmp_path_factory.mktemp("quantized-gpt-oss")
    built: dict = {}

    def get(recipe: str):
        if recipe not in built:
            out = root / recipe
            built[recipe] = out, run_quantize(
                tiny_family(NAME), write_recipe(root / f"{recipe}.yaml", RECIPES[recipe]), out,
                samples=4, seq_len=SEQ)
        return built[recipe]

    return get


def _max_rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    assert len(got) == len(want)
    return [((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want)]


# --- the block forward --------------------------------------------------------------------

def test_block_forward_equals_transformers(tiny_family):
    """float32, 2 x 40 tokens (past the window of 8): the quantizer's calibration forward
    (sinks, biases, per-layer windows, YaRN, the router's bias and top-k-then-softmax,
    each expert's clamped SwiGLU on its own gate/up/down linears) within 1e-5 of
    transformers' decoder layers after every layer (measured 4e-8 to 2e-7)."""
    path = tiny_family(NAME)
    ids = _ids()
    errors = _max_rel(stream_hidden_states(path, ids), hf_hidden_states(path, ids))
    assert max(errors) < 1e-5, errors


def test_block_forward_on_mxfp4_experts(tiny_family, mxfp4_model):
    """The MXFP4 checkpoint: the quantizer decodes its experts as transformers'
    ``convert_moe_packed_tensors`` does; within 1e-5 of transformers with those experts."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path, packed = mxfp4_model
    model = AutoModelForCausalLM.from_pretrained(str(tiny_family(NAME)), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    params = dict(model.named_parameters())
    want: list[torch.Tensor] = []
    with torch.no_grad():
        for name, (blocks, scales) in packed.items():
            params[name].copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    for layer in model.model.layers:
        layer.register_forward_hook(lambda m, a, out: want.append(out[0] if isinstance(
            out, tuple) else out))
    ids = _ids()
    with torch.inference_mode():
        model(ids)
    errors = _max_rel(stream_hidden_states(path, ids), want)
    assert max(errors) < 1e-5, errors


# --- the fused experts as per-expert linears ---------------------------------------------

def test_fused_experts_read_as_llm_compressor_linearizes_them(tiny_family, mxfp4_model):
    """``experts.{e}.gate_proj.weight = gate_up_proj[e][:, ::2].T`` (up: the odd columns),
    ``down_proj.weight = down_proj[e].T``, the biases likewise; the fused tensors hidden;
    MXFP4 decoded (its quantization_config dropped: the checkpoint reads as float)."""
    from llmctl.quant import mxfp4

    source = _tensors(tiny_family(NAME))
    ckpt = Checkpoint(tiny_family(NAME))
    names = ckpt.names()
    assert not any(n.endswith(("gate_up_proj", "down_proj", "_bias")) for n in names)
    assert len([n for n in names if ".experts." in n]) == 3 * 4 * 3 * 2
    fused = "model.layers.1.mlp.experts"
    for e in range(4):
        expert = f"model.layers.1.mlp.experts.{e}"
        gate_up, bias = source[f"{fused}.gate_up_proj"][e], source[f"{fused}.gate_up_proj_bias"][e]
        assert torch.equal(ckpt.get(f"{expert}.gate_proj.weight"), gate_up[:, ::2].T)
        assert torch.equal(ckpt.get(f"{expert}.up_proj.weight"), gate_up[:, 1::2].T)
        assert torch.equal(ckpt.get(f"{expert}.gate_proj.bias"), bias[::2])
        assert torch.equal(ckpt.get(f"{expert}.up_proj.bias"), bias[1::2])
        assert torch.equal(ckpt.get(f"{expert}.down_proj.weight"), source[f"{fused}.down_proj"][e].T)
        assert torch.equal(ckpt.get(f"{expert}.down_proj.bias"),
                           source[f"{fused}.down_proj_bias"][e])
        assert ckpt.shape(f"{expert}.gate_proj.weight") == (32, 64)
        assert ckpt.shape(f"{expert}.down_proj.weight") == (64, 32)
    path, packed = mxfp4_model
    ckpt = Checkpoint(path)
    assert "quantization_config" not in ckpt.config
    blocks, scales = packed[f"{fused}.down_proj"]
    decoded = mxfp4.dequantize(blocks, scales, torch.float32)
    assert torch.equal(ckpt.get(f"{fused}.2.down_proj.weight", torch.float32), decoded[2])


# --- every method, per expert -------------------------------------------------------------

@pytest.mark.parametrize("recipe", ["w4a16-rtn-g16", "w4a16-gptq", "w4a16-awq", "fp8-dynamic",
                                    "int8-smoothquant"])
def test_every_method_per_expert(tiny_family, quantized, recipe):
    """Every expert's gate/up/down quantized on its own with its bias written as it was;
    the report's tokens consistent with top-2 routing and calibrate_all_experts (each
    expert's statistics see every token); the routers (weight and bias) and the sinks
    bit-identical and named in ``ignore``; no expert folded (the clamped SwiGLU is not
    linear in up)."""
    out, report = quantized(recipe)
    names = {r["name"] for r in report["linears"]}
    # the W4A16 recipes' experts are in vLLM's streamed form: read back per linear
    source, written = _tensors(tiny_family(NAME)), vllm_gpt_oss.to_per_linear(_tensors(out), 4)
    for i in range(3):
        for e in range(4):
            for part in PARTS:
                name = f"model.layers.{i}.mlp.experts.{e}.{part}"
                assert name in names
                fused = {"gate_proj": "gate_up_proj_bias", "up_proj": "gate_up_proj_bias",
                         "down_proj": "down_proj_bias"}[part]
                bias = source[f"model.layers.{i}.mlp.experts.{fused}"][e]
                bias = {"gate_proj": bias[::2], "up_proj": bias[1::2]}.get(part, bias)
                assert torch.equal(written[f"{name}.bias"], bias)
        for kept in ("mlp.router.weight", "mlp.router.bias", "self_attn.sinks"):
            key = f"model.layers.{i}.{kept}"
            assert torch.equal(written[key], source[key]), key
        rows = [r for r in report["experts"]["experts"] if r["layer"] == i]
        assert len(rows) == 4 and all(len(r["rel_error"]) == 3 for r in rows)
        if not report["calibration"].get("data_free"):
            tokens = report["calibration"]["tokens"]
            assert sum(r["routed_tokens"] for r in rows) == 2 * tokens
            assert all(r["stat_tokens"] == tokens for r in rows)
    assert not any(".experts.gate_up_proj" in k or k.endswith("experts.down_proj")
                   for k in written)
    assert all(0 < r["rel_error"] < 1 for r in report["linears"])
    assert report["experts"]["under_calibrated"] == [] and report["experts"]["calibrate_all_experts"]
    expected = ((vllm_gpt_oss.FORM, "transformers 5 does not") if recipe.startswith("w4a16")
                else (vllm_gpt_oss.PER_LINEAR_FORM, "vLLM 0.32 does not load them"))
    assert any(all(part in w for part in expected) for w in report["warnings"])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert {f"model.layers.{i}.mlp.router" for i in range(3)} <= set(qc["ignore"])
    notes = {r["name"]: r["smoothing"] for r in report["linears"]}
    assert all(notes[n] is None for n in names if ".experts." in n)
    if recipe == "w4a16-awq":
        assert notes["model.layers.0.self_attn.q_proj"] is not None


def test_an_expert_without_tokens(tiny_family, tmp_path, starve_expert_0):  # noqa: F811
    """calibrate_all_experts off, expert 0 never routed: it is quantized round-to-nearest,
    reported under-calibrated and named in a warning; its scales finite."""
    text = RECIPES["w4a16-gptq"].replace(
        "ignore: [lm_head]", "ignore: [lm_head]\n      calibrate_all_experts: false")
    out = tmp_path / "out"
    report = run_quantize(tiny_family(NAME), write_recipe(tmp_path / "r.yaml", text), out,
                          samples=4, seq_len=SEQ)
    starved = [f"model.layers.{i}.mlp.experts.0" for i in range(3)]
    assert report["experts"]["under_calibrated"] == starved
    methods = {r["name"]: r["method"] for r in report["linears"]}
    assert methods["model.layers.0.mlp.experts.0.gate_proj"] == "rtn"
    assert methods["model.layers.0.mlp.experts.1.gate_proj"] == "gptq"
    assert any(all(n in w for n in starved[:1]) for w in report["warnings"])
    for key, tensor in _tensors(out).items():
        if key.endswith("_scale"):
            assert torch.isfinite(tensor.float()).all() and (tensor.float() > 0).all(), key


# --- the checkpoint in the engine --------------------------------------------------------

def dequantized_reference(source: Path, out: Path):
    """transformers' float32 gpt-oss holding ``out``'s weights as llmctl decodes them
    (``reference.decode_weight``), each expert put back into the fused tensors (gate in
    the even columns, up in the odd ones, as the linearization took them out)."""
    from transformers import AutoModelForCausalLM

    from llmctl.quant.reference import decode_weight

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = next(iter(qc["config_groups"].values()))
    tensors = vllm_gpt_oss.to_per_linear(_tensors(out), scheme["weights"]["num_bits"])
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key in [k for k in tensors if k.endswith(".weight_scale")]:
            module = key.removesuffix(".weight_scale")
            w = decode_weight(module, tensors, scheme, scheme.get("format") or qc["format"])
            if ".experts." not in module:
                params[f"{module}.weight"].copy_(w)
                continue
            layer, rest = module.split(".experts.")
            e, part = int(rest.split(".")[0]), rest.split(".")[1]
            if part == "down_proj":
                params[f"{layer}.experts.down_proj"][e] = w.T
            else:
                column = 0 if part == "gate_proj" else 1
                params[f"{layer}.experts.gate_up_proj"][e, :, column::2] = w.T
    return model


@pytest.mark.parametrize("recipe", ["w4a16-rtn-g16", "fp8-dynamic"])
def test_the_engine_serves_it_as_transformers_computes_it(tiny_family, quantized, recipe):
    """quant_backend "dequantize", float32: the engine's logits on the quantized
    checkpoint within 1e-5 of the largest logit of transformers on the dequantized
    weights (measured 4e-7 for int4), the same greedy tokens (float32 both sides); and
    the quantization moved the logits (it is not the float model by another name)."""
    from llmctl.serve.core.sampling_params import SamplingParams
    from llmctl.serve.engine.llm import LLM
    from llmctl.serve.model.scoring import teacher_forced_logits

    out, _ = quantized(recipe)
    reference = dequantized_reference(tiny_family(NAME), out)
    ids = _ids(seed=2)[0].tolist()[:24]
    llm = LLM(str(out), dtype="float32", quant_backend="dequantize", kv_cache_memory="8MiB",
              block_size=4)
    got = teacher_forced_logits(llm.engine, ids, 1)
    with torch.inference_mode():
        want = reference(torch.tensor([ids])).logits[0].float()
        ref_tokens = reference.generate(torch.tensor([ids]), max_new_tokens=16,
                                        do_sample=False)[0, len(ids):].tolist()
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    (done,) = llm.generate([ids], params)
    assert done.outputs[0].token_ids == ref_tokens
    with torch.inference_mode():
        base = _hf(tiny_family(NAME))(torch.tensor([ids])).logits[0].float()
    assert (base - want).abs().max() > 1e-3


def test_mxfp4_in_compressed_tensors_out(mxfp4_model, tmp_path):
    """The MXFP4 checkpoint quantized to FP8: config.json says compressed-tensors (no
    mxfp4 left), and the engine serves it as transformers computes it."""
    from llmctl.serve.engine.llm import LLM
    from llmctl.serve.model.scoring import teacher_forced_logits

    path, _ = mxfp4_model
    out = tmp_path / "out"
    run_quantize(path, write_recipe(tmp_path / "r.yaml", RECIPES["fp8-dynamic"]), out,
                 samples=4, seq_len=SEQ)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    ids = _ids(seed=3)[0].tolist()[:24]
    llm = LLM(str(out), dtype="float32", quant_backend="dequantize", kv_cache_memory="8MiB",
              block_size=4)
    got = teacher_forced_logits(llm.engine, ids, 1)
    with torch.inference_mode():
        want = dequantized_reference(path, out)(torch.tensor([ids])).logits[0].float()
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


# --- recipes and the command line -------------------------------------------------------

def test_a_pattern_that_matches_nothing_names_the_closest_modules(tiny_family, tmp_path):
    """Mixtral's w1 on gpt-oss matches nothing: exit 2, one line naming its expert modules."""
    recipe = write_recipe(tmp_path / "bad.yaml", RECIPES["w4a16-rtn-g16"].replace(
        "ignore: [lm_head]", 'ignore: [lm_head, "re:.*experts.*w1$"]'))
    result = _cli("quantize", str(tiny_family(NAME)), "-r", str(recipe), "--dry-run")
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "re:.*experts.*w1$" in text and "mlp.experts.0." in text


def test_dry_run_shows_the_experts_and_the_router(tiny_family, tmp_path):
    recipe = write_recipe(tmp_path / "awq.yaml", RECIPES["w4a16-awq"])
    result = _cli("quantize", str(tiny_family(NAME)), "-r", str(recipe), "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    experts = data["experts"]
    assert experts["experts"] == 4 and experts["experts_per_token"] == 2
    assert experts["routers_kept"] == [f"model.layers.{i}.mlp.router" for i in range(3)]
    assert experts["calibrate_all_experts"] is True
