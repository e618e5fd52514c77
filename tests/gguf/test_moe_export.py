"""Mixtures of experts through GGUF export (llmctl.gguf.experts): Mixtral (llama.cpp's
llama graph with experts), Qwen2-MoE with its shared expert, Qwen3-MoE and gpt-oss (its
fused, interleaved experts cut into llama.cpp's gate/up/down stacks), run by the pinned
llama.cpp against transformers; what its graphs cannot compute refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmctl.errors import UnsupportedArchitectureError
from llmctl.gguf.export import quantize_to_gguf
from llmctl.gguf.writer import build_plan
from tests.tiny import FAMILY_CONFIGS

IDS = list(range(3, 43))
# float32 on both sides, routing included: the dense families' SiLU bound
TOLERANCE = 2e-5
# llama.cpp's qwen2moe graph has no dense layers: the tiny config's mlp_only_layers [1] out;
# its gpt-oss graph fixes the SwiGLU limit at 7.0 (the tiny config's 1.5 makes the engine's
# clamps bite) and always rounds YaRN's correction range (truncate: true)
_GPT_OSS_ROPE = json.loads((FAMILY_CONFIGS / "gpt_oss.json").read_text())["rope_parameters"]
VARIANTS = {"mixtral": {}, "qwen2_moe": {"mlp_only_layers": []}, "qwen3_moe": {},
            "gpt_oss": {"swiglu_limit": 7.0, "rope_parameters": {**_GPT_OSS_ROPE,
                                                                 "truncate": True}}}


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from tests.tiny import build_tiny_llama

    root, built = tmp_path_factory.mktemp("gguf-moe"), {}

    def make(name: str, **overrides):
        key = json.dumps([name, overrides], sort_keys=True)
        if key not in built:
            config = json.loads((FAMILY_CONFIGS / f"{name}.json").read_text())
            config.update(VARIANTS[name], **overrides)
            built[key] = build_tiny_llama(root / f"m{len(built)}",
                                          layers=config.pop("num_hidden_layers"), **config)
        return built[key]
    return make


def _logits(model_dir, gguf_path):
    from llmctl.gguf.compare import llamacpp_logits, transformers_logits

    return transformers_logits(model_dir, [IDS])[0], llamacpp_logits(gguf_path, [IDS])[0]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_f32_export_runs_in_llama_cpp_like_transformers(llama_cpp, moe_model, tmp_path, name):
    model = moe_model(name)
    summary = quantize_to_gguf(model, tmp_path / f"{name}.gguf", "F32")
    ref, ours = _logits(model, summary["path"])
    np.testing.assert_allclose(ours, ref, atol=TOLERANCE * np.abs(ref).max(), rtol=0)


def test_experts_are_stacked_per_layer_in_expert_order(moe_model):
    """The plan (what --dry-run prints): one [E, out, in] tensor per projection and layer,
    from the per-expert tensors in order; the router and the shared expert one to one."""
    from safetensors.numpy import load_file

    from llmctl.gguf.writer import write_gguf

    model = moe_model("qwen2_moe")
    _, _, plan = build_plan(model, "F32")
    by_name = {p.name: p for p in plan}
    gate = by_name["blk.1.ffn_gate_exps.weight"]
    assert gate.shape == (6, 32, 64) and gate.source == "model.layers.1.mlp.experts.{e}.gate_proj.weight"
    assert gate.parts == tuple(f"model.layers.1.mlp.experts.{e}.gate_proj.weight" for e in range(6))
    assert by_name["blk.1.ffn_down_exps.weight"].shape == (6, 64, 32)
    assert by_name["blk.0.ffn_gate_inp.weight"].shape == (6, 64)
    assert by_name["blk.0.ffn_up_shexp.weight"].shape == (48, 64)
    assert by_name["blk.0.ffn_gate_inp_shexp.weight"].shape == (1, 64)
    assert not any("experts.0." in p.name or p.source and ".experts.0." in p.source
                   for p in plan)  # no expert left unstacked
    import gguf

    out = write_gguf(model, model.parent / "stacked.gguf", plan, 0)
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in reader.tensors}
    weights = load_file(str(model / "model.safetensors"))
    got = np.asarray(tensors["blk.1.ffn_up_exps.weight"].data)
    want = np.stack([weights[f"model.layers.1.mlp.experts.{e}.up_proj.weight"]
                     for e in range(6)]).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    fields = {f.name: f.contents() for f in reader.fields.values()}
    assert fields["qwen2moe.expert_count"] == 6 and fields["qwen2moe.expert_used_count"] == 2
    assert fields["qwen2moe.expert_feed_forward_length"] == 32
    assert fields["qwen2moe.expert_shared_feed_forward_length"] == 48


@pytest.mark.parametrize("name, change, reason", [
    ("qwen2_moe", {"mlp_only_layers": [1]}, r"no dense layers among the experts \(layers \[1\]\)"),
    ("qwen3_moe", {"norm_topk_prob": False}, "its graph renormalises the top-k"),
    ("qwen2_moe", {"norm_topk_prob": True}, "does not renormalise the top-k"),
    ("gpt_oss", {"swiglu_limit": 1.5}, "fixes swiglu_limit at 7.0, the model's is 1.5"),
    ("gpt_oss", {"swiglu_alpha": 1.5}, "fixes swiglu_alpha at 1.702"),
    ("gpt_oss", {"rope_parameters": {**_GPT_OSS_ROPE, "truncate": True, "beta_fast": 16.0}},
     "takes beta_fast 32, the model's is 16.0"),
])
def test_what_the_moe_graphs_do_not_compute_is_refused(moe_model, tmp_path, name, change,
                                                       reason):
    with pytest.raises(UnsupportedArchitectureError, match=reason) as caught:
        quantize_to_gguf(moe_model(name, **change), tmp_path / "x.gguf", "F32")
    assert "\n" not in caught.value.args[0]
    assert not (tmp_path / "x.gguf").exists()


def test_gpt_oss_yarn_without_truncation_exports_with_a_warning(moe_model, tmp_path, caplog):
    """gpt-oss's own config says truncate: false; llama.cpp always rounds YaRN's correction
    range (its converter writes these models anyway): the export goes ahead and says so,
    and a config with truncate: true exports silently."""
    import logging

    with caplog.at_level(logging.WARNING, logger="llmctl.gguf.writer"):
        quantize_to_gguf(moe_model("gpt_oss", rope_parameters=_GPT_OSS_ROPE),
                         tmp_path / "x.gguf", "F32")
    assert (tmp_path / "x.gguf").exists()
    warned = [r.getMessage() for r in caplog.records if "truncate: false" in r.getMessage()]
    assert len(warned) == 1 and "set truncate: true" in warned[0], caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmctl.gguf.writer"):
        quantize_to_gguf(moe_model("gpt_oss"), tmp_path / "y.gguf", "F32")
    assert "truncate" not in caplog.text


def test_q8_0_experts_run_in_llama_cpp(llama_cpp, moe_model, tmp_path):
    """llmctl's own Q8_0 on the 3-D expert tensors (blocks of 32 along each row): each
    stacked expert dequantizes (gguf-py) to within half a Q8_0 step (and the step's fp16 rounding) of its own weights, and
    llama.cpp runs the file. Its logits are held per position: a few positions route to
    another expert after the rounding (measured 2 of 40, errors ~0.7-1.0 against ~0.08
    elsewhere), so the median position's largest error is bounded, and the argmax."""
    import gguf
    from gguf.quants import dequantize
    from safetensors.numpy import load_file

    model = moe_model("qwen3_moe")
    summary = quantize_to_gguf(model, tmp_path / "q8.gguf", "Q8_0")
    weights = load_file(str(model / "model.safetensors"))
    (stack,) = [t for t in gguf.GGUFReader(str(summary["path"])).tensors
                if t.name == "blk.1.ffn_up_exps.weight"]
    got = dequantize(stack.data, stack.tensor_type).reshape(8, 32, 64)
    want = np.stack([weights[f"model.layers.1.mlp.experts.{e}.up_proj.weight"]
                     for e in range(8)])
    step = np.abs(want).reshape(8, 32, 2, 32).max(-1, keepdims=True) / 127  # per block
    # half a step, plus 127 times the fp16 rounding of the stored step (2**-11 relative)
    bound = step * (0.5 + 127 * 2.0 ** -11)
    assert (np.abs(got - want).reshape(8, 32, 2, 32) <= bound).all()
    ref, ours = _logits(model, summary["path"])
    assert np.median(np.abs(ours - ref).max(-1)) <= 0.03 * np.abs(ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def _gguf_tensors(path) -> dict[str, np.ndarray]:
    import gguf

    return {t.name: np.asarray(t.data).reshape(tuple(int(d) for d in reversed(t.shape)))
            for t in gguf.GGUFReader(str(path)).tensors}


def test_gpt_oss_experts_are_cut_from_the_fused_tensors(moe_model):
    """The plan: gate_up_proj [E, H, 2I] (x @ W, gate and up columns interleaved) becomes
    ffn_gate_exps (its even output features) and ffn_up_exps (the odd ones), rows first
    [E, I, H]; down_proj [E, I, H] becomes ffn_down_exps [E, H, I]; each bias cut the same
    way and kept F32 whatever the type; the router's bias and the sinks one to one."""
    from safetensors.numpy import load_file

    from llmctl.gguf.writer import write_gguf

    model = moe_model("gpt_oss")
    _, _, plan = build_plan(model, "Q8_0")
    by_name = {p.name: p for p in plan}
    gate, up = by_name["blk.1.ffn_gate_exps.weight"], by_name["blk.1.ffn_up_exps.weight"]
    assert gate.shape == up.shape == (4, 32, 64) and gate.type == "Q8_0"
    assert gate.source == up.source == "model.layers.1.mlp.experts.gate_up_proj"
    assert (gate.cut.part, gate.cut.parts, up.cut.part) == (0, 2, 1)
    assert by_name["blk.1.ffn_down_exps.weight"].shape == (4, 64, 32)
    for name, shape in (("ffn_gate_exps.bias", (4, 32)), ("ffn_up_exps.bias", (4, 32)),
                        ("ffn_down_exps.bias", (4, 64)), ("ffn_gate_inp.bias", (4,)),
                        ("attn_sinks.weight", (4,)), ("attn_output.bias", (64,))):
        assert by_name[f"blk.1.{name}"].shape == shape and by_name[f"blk.1.{name}"].type == "F32"
    assert by_name["blk.1.post_attention_norm.weight"].source \
        == "model.layers.1.post_attention_layernorm.weight"
    _, _, plan = build_plan(model, "F32")
    got = _gguf_tensors(write_gguf(model, model.parent / "cut.gguf", plan, 0))
    weights = load_file(str(model / "model.safetensors"))
    fused = weights["model.layers.1.mlp.experts.gate_up_proj"].transpose(0, 2, 1)
    np.testing.assert_array_equal(got["blk.1.ffn_gate_exps.weight"], fused[:, 0::2])
    np.testing.assert_array_equal(got["blk.1.ffn_up_exps.weight"], fused[:, 1::2])
    np.testing.assert_array_equal(got["blk.1.ffn_down_exps.weight"],
                                  weights["model.layers.1.mlp.experts.down_proj"].transpose(0, 2, 1))
    bias = weights["model.layers.1.mlp.experts.gate_up_proj_bias"]
    np.testing.assert_array_equal(got["blk.1.ffn_up_exps.bias"], bias[:, 1::2])


def _mxfp4_pair(model, root):
    """``model`` with its experts in MXFP4 (``_blocks``/``_scales`` of ``[E, out, in]``, as
    gpt-oss ships them; llmctl's encoder), and the float checkpoint holding the decoded
    values (transformers' decoding): (packed dir, decoded dir)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from llmctl.quant import mxfp4

    packed, decoded = root / "mxfp4", root / "decoded"
    weights = load_file(str(model / "model.safetensors"))
    packed_weights, decoded_weights = dict(weights), dict(weights)
    for name in [n for n in weights if n.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = mxfp4.quantize(weights[name].transpose(1, 2))
        del packed_weights[name]
        packed_weights[f"{name}_blocks"], packed_weights[f"{name}_scales"] = blocks, scales
        values = mxfp4.dequantize(blocks, scales, torch.float32).transpose(1, 2)
        decoded_weights[name] = values.contiguous()
    for out, tensors in ((packed, packed_weights), (decoded, decoded_weights)):
        shutil.copytree(model, out)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return packed, decoded


def test_gpt_oss_mxfp4_experts_export_as_their_decoded_values(moe_model, tmp_path):
    """A checkpoint with the experts in MXFP4 exports, tensor for tensor, the F32 file of
    the float checkpoint holding the decoded values (exact in float32): the float file
    is the one llama.cpp runs like transformers above."""
    packed, decoded = _mxfp4_pair(moe_model("gpt_oss"), tmp_path)
    plan = build_plan(packed, "F32")[2]
    assert {p.name: p.shape for p in plan} == {p.name: p.shape
                                               for p in build_plan(decoded, "F32")[2]}
    got = _gguf_tensors(quantize_to_gguf(packed, tmp_path / "packed.gguf", "F32")["path"])
    want = _gguf_tensors(quantize_to_gguf(decoded, tmp_path / "decoded.gguf", "F32")["path"])
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_gpt_oss_mxfp4_moe_keeps_the_experts_exactly(llama_cpp, moe_model, tmp_path):
    """MXFP4_MOE (llama-quantize's mixture: expert stacks MXFP4, the other matrices Q8_0)
    from MXFP4 experts: every expert value comes back exactly (the decoded values are on
    the MXFP4 grid, so the re-encoding loses nothing), and llama.cpp runs the file near
    transformers on the decoded checkpoint (the Q8_0 attention and its 8-bit activations
    are the error, bounded as the Q8_0 experts' test bounds it)."""
    import gguf
    from gguf.quants import dequantize

    packed, decoded = _mxfp4_pair(moe_model("gpt_oss"), tmp_path)
    summary = quantize_to_gguf(packed, tmp_path / "mxfp4.gguf", "MXFP4_MOE")
    tensors = {t.name: t for t in gguf.GGUFReader(str(summary["path"])).tensors}
    want = _gguf_tensors(quantize_to_gguf(decoded, tmp_path / "f32.gguf", "F32")["path"])
    for name, t in tensors.items():
        kind = t.tensor_type.name
        if name.endswith("_exps.weight"):
            assert kind == "MXFP4", name
            got = dequantize(t.data, t.tensor_type).reshape(want[name].shape)
            np.testing.assert_array_equal(got, want[name], err_msg=name)
        else:
            assert kind == ("Q8_0" if name.endswith(".weight") and t.n_elements > t.shape[0]
                            else "F32"), name
    ref, ours = _logits(decoded, summary["path"])
    assert np.median(np.abs(ours - ref).max(-1)) <= 0.03 * np.abs(ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_gpt_oss_tensor_names_are_gguf_pys():
    """Every name the export writes is where gguf-py's tensor map (llama.cpp's converter)
    puts the HF tensor it comes from: the sinks under the ``.weight`` the converter's
    filter_tensors adds, each cut under the name its modify_tensors gives that part
    (``gate_up_proj`` -> ``gate_proj`` / ``up_proj``, ``down_proj``, each ``.weight`` or
    ``.bias``)."""
    import gguf

    from llmctl.models import gguf_experts
    from llmctl.models.architectures import expand_tensor_names, get_architecture

    arch = get_architecture("gpt_oss")
    mapping = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, 2)
    names = {**expand_tensor_names(arch, 2), **gguf_experts.single_names(arch, 2)}
    for hf, ours in names.items():
        hf = f"{hf}.weight" if hf.endswith(".sinks") else hf
        assert mapping.get_name(hf, try_suffixes=(".weight", ".bias")) == ours, hf
    cuts = gguf_experts.cut_names(arch, 2)
    assert len(cuts) == 2 * 3 * 2  # layers x (gate, up, down) x (weight, bias)
    for ours, cut in cuts.items():
        base = cut.source.removesuffix("_bias")
        if cut.parts == 2:
            base = base.replace("gate_up_proj", ("gate_proj", "up_proj")[cut.part])
        hf = base + (".bias" if cut.source.endswith("_bias") else ".weight")
        assert mapping.get_name(hf, try_suffixes=(".weight", ".bias")) == ours, hf


def test_llmctl_quantize_writes_gpt_oss_gguf(moe_model, tmp_path):
    """``llmctl quantize --format gguf`` takes gpt-oss (no longer refused as engine-only):
    the file holds llama.cpp's gpt-oss tensors."""
    import gguf
    from typer.testing import CliRunner

    from llmctl.cli.app import build_app

    out = tmp_path / "gpt-oss-q8.gguf"
    result = CliRunner().invoke(build_app(), ["quantize", str(moe_model("gpt_oss")), "--format",
                                              "gguf", "--type", "Q8_0", "-o", str(out)])
    assert result.exit_code == 0, result.output
    reader = gguf.GGUFReader(str(out))
    assert reader.fields["general.architecture"].contents() == "gpt-oss"
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.2.ffn_up_exps.weight"] == "Q8_0" and types["blk.2.ffn_up_exps.bias"] == "F32"
    assert reader.fields["gpt-oss.attention.sliding_window_pattern"].contents() == [True, False,
                                                                                    True]
