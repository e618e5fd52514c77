"""Gemma 1/2/3, Phi-3, Granite and OLMo 2 through GGUF: exported files run by the pinned
llama.cpp against transformers, refusals of what its graphs cannot compute, and the way
back (import, serving the file) against the original weights and logits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from llmctl.errors import UnsupportedArchitectureError
from llmctl.gguf.export import quantize_to_gguf
from tests.gguf.conftest import LLAMA_CPP_VARIANTS

FAMILIES = sorted(LLAMA_CPP_VARIANTS)
IDS = list(range(3, 43))  # 40 tokens: past the tiny windows (8) and Phi-3's original 32
# ggml's CPU GeLU reads an fp16 table (GGML_GELU_FP16): ~3 digits on every MLP activation.
# The SiLU families run float32 throughout: the bound of the other families' exports.
TOLERANCE = {"gemma": 2e-3, "gemma2": 2e-3, "gemma3": 2e-3}
SILU_TOLERANCE = 2e-5


def _transformers(model_dir, ids=IDS) -> np.ndarray:
    from llmctl.gguf.compare import transformers_logits

    return transformers_logits(model_dir, [ids])[0]


def _llamacpp(path, ids=IDS) -> np.ndarray:
    from llmctl.gguf.compare import llamacpp_logits

    return llamacpp_logits(path, [ids])[0]


@pytest.mark.parametrize("name", FAMILIES)
def test_f32_export_runs_in_llama_cpp_like_transformers(llama_cpp, gguf_family, tmp_path, name):
    model = gguf_family(name)
    summary = quantize_to_gguf(model, tmp_path / f"{name}.gguf", "F32")
    ref, ours = _transformers(model), _llamacpp(summary["path"])
    atol = TOLERANCE.get(name, SILU_TOLERANCE) * np.abs(ref).max()
    np.testing.assert_allclose(ours, ref, atol=atol, rtol=0)


def test_phi3_short_factors_where_the_context_is_within_the_original(llama_cpp, gguf_family,
                                                                     tmp_path):
    """LongRoPE picks its factors by length: transformers by the sequence's, llama.cpp by
    the context's (at least 256 here). With an original context of 256 both pick the
    short factors (the tiny config's 32 tests the long ones, above)."""
    model = gguf_family("phi3", original_max_position_embeddings=256,
                        max_position_embeddings=1024)
    summary = quantize_to_gguf(model, tmp_path / "phi3-short.gguf", "F32")
    ref, ours = _transformers(model), _llamacpp(summary["path"])
    np.testing.assert_allclose(ours, ref, atol=SILU_TOLERANCE * np.abs(ref).max(), rtol=0)


@pytest.mark.parametrize("name, reason", [
    ("gemma", "gemma graph cannot run this gemma model: its graph uses token_embd"),
    ("gemma2", "scales q.k by 0.25, the model by 0.204124"),
    ("phi3", "ignores Phi-3's sliding window (16 tokens"),
])
def test_what_llama_cpp_cannot_run_is_refused_in_one_line(tiny_family, tmp_path, name, reason):
    """The tiny configs as they are: untied Gemma 1/2, Gemma 2's query_pre_attn_scalar 24
    for a head of 16, Phi-3's window of 16 tokens within a context of 256."""
    with pytest.raises(UnsupportedArchitectureError) as caught:
        quantize_to_gguf(tiny_family(name), tmp_path / f"{name}.gguf", "F32")
    message = caught.value.args[0]
    assert reason in message and "\n" not in message
    assert not (tmp_path / f"{name}.gguf").exists()


@pytest.mark.parametrize("name, change, reason", [
    ("gemma3", {"final_logit_softcapping": 30.0}, "gemma3 graph .* no final logit"),
    ("olmo2", {"hidden_act": "gelu"}, "olmo2 graph .* applies silu, the model gelu"),
])
def test_what_the_graph_does_not_compute_is_refused(gguf_family, tmp_path, name, change,
                                                    reason):
    model = gguf_family(name, **change)
    with pytest.raises(UnsupportedArchitectureError, match=reason):
        quantize_to_gguf(model, tmp_path / "refused.gguf", "F32")


def _state(directory) -> dict[str, np.ndarray]:
    return load_file(str(directory / "model.safetensors"))


def _assert_same_weights(original: dict, back: dict, name: str) -> None:
    assert original.keys() == back.keys()
    for key, ref in original.items():
        if name.startswith("gemma") and key.endswith("norm.weight"):
            # stored as w + 1 (llama.cpp's converter), read back as (w + 1) - 1 in float32
            np.testing.assert_allclose(back[key], ref, atol=2.0 ** -24, rtol=0, err_msg=key)
        else:
            np.testing.assert_array_equal(back[key], ref, err_msg=key)


@pytest.mark.parametrize("name", FAMILIES)
def test_f32_round_trip_and_serving_the_file(gguf_family, tmp_path, name):
    """HF -> F32 GGUF -> HF gives back the weights and a config transformers runs to the
    same logits; the engine serving the .gguf itself agrees with transformers."""
    from llmctl.models.gguf_import import import_gguf
    from llmctl.serve.engine.llm import LLM
    from tests.serve.model.test_model import engine_logits

    model = gguf_family(name)
    path = quantize_to_gguf(model, tmp_path / f"{name}.gguf", "F32")["path"]
    back = import_gguf(path, tmp_path / "imported")
    _assert_same_weights(_state(model), _state(back), name)
    ref = torch.from_numpy(_transformers(model))
    torch.testing.assert_close(torch.from_numpy(_transformers(back)), ref,
                               atol=1e-5 * float(ref.abs().max()), rtol=0)
    llm = LLM(str(path), kv_cache_memory="4MiB", block_size=4)
    got = engine_logits(llm, IDS, 7)
    # the engine's bound against transformers (tests/serve/model/test_model.py)
    torch.testing.assert_close(got, ref[6:], atol=2e-4, rtol=1e-4)


def test_imported_config_keeps_the_family_fields(gguf_family, tmp_path):
    from llmctl.models.gguf_import import import_gguf

    model = gguf_family("gemma3")
    path = quantize_to_gguf(model, tmp_path / "g3.gguf", "F32")["path"]
    config = json.loads((import_gguf(path, tmp_path / "imported") / "config.json").read_text())
    original = json.loads((model / "config.json").read_text())
    assert config["layer_types"] == original["layer_types"]
    assert config["rope_parameters"] == original["rope_parameters"]
    assert (config["sliding_window"], config["query_pre_attn_scalar"]) == (8, 16)


@pytest.mark.parametrize("name, gguf_type", [("phi3", "Q8_0"), ("granite", "Q4_0"),
                                             ("gemma3", "Q4_1")])
def test_legacy_quants_served_natively_match_their_float_reading(gguf_family, tmp_path, name,
                                                                 gguf_type):
    """Q4_0/Q4_1/Q8_0 stay codes on the low-bit kernel: Phi-3's fused projections, Granite's
    permuted q/k rows, Gemma 3's shifted norms, against the same file read as float."""
    from llmctl.gguf.writer import export_gguf
    from llmctl.serve.engine.llm import LLM
    from llmctl.serve.layers.lowbit import LowBitLinear
    from tests.serve.model.test_model import engine_logits

    path = export_gguf(gguf_family(name), tmp_path / f"{name}-{gguf_type}.gguf", gguf_type)
    native = LLM(str(path), kv_cache_memory="4MiB")
    ref = LLM(str(path), kv_cache_memory="4MiB", gguf_weights="float")
    assert not isinstance(ref.engine.target.model.layers[0].qkv, LowBitLinear)
    got, want = engine_logits(native, IDS, 9), engine_logits(ref, IDS, 9)
    # the bound of tests/serve/layers/test_lowbit.py: same weights, bf16 activations
    torch.testing.assert_close(got, want, atol=0.25, rtol=0.02)


@pytest.mark.parametrize("name", ["gemma2", "granite", "olmo2"])
def test_legacy_quant_exports_run_in_llama_cpp_ordered_by_precision(llama_cpp, gguf_family,
                                                                    tmp_path, name):
    """llmctl's own Q8_0/Q4_0 writer for the new archs, run by llama.cpp: mean KL from
    transformers' float32 logits grows F32 < Q8_0 < Q4_0 (measured: ~1e-7 / 1e-6..8e-4 /
    2e-4..0.13 on these models), and Q8_0 stays near the float model."""
    from llmctl.eval.metrics import dense_position_stats

    model = gguf_family(name)
    ref = _transformers(model)
    kld = {}
    for gguf_type in ("F32", "Q8_0", "Q4_0"):
        path = quantize_to_gguf(model, tmp_path / f"{gguf_type}.gguf", gguf_type)["path"]
        ours = _llamacpp(path)
        kld[gguf_type] = float(dense_position_stats(ref[:-1], ours[:-1],
                                                    np.asarray(IDS[1:])).kld.mean())
    assert kld["F32"] < 1e-6 and kld["Q8_0"] < 2e-3, kld
    assert kld["F32"] < kld["Q8_0"] < kld["Q4_0"], kld


@pytest.mark.parametrize("model_type", ["gemma", "gemma2", "gemma3_text", "phi3", "granite",
                                        "olmo2"])
def test_tensor_names_are_gguf_pys_for_the_arch(model_type):
    """Every HF name maps where gguf-py's tensor_mapping maps it for that llama.cpp arch
    (Gemma 1/2 have no output tensor there: their exports are tied or refused, above)."""
    import gguf

    from llmctl.models.architectures import expand_tensor_names, get_architecture

    arch = get_architecture(model_type)
    gguf_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch.gguf_arch)
    mapping = gguf.get_tensor_name_map(gguf_arch, 2)
    has_output = gguf.MODEL_TENSOR.OUTPUT in gguf.MODEL_TENSORS[gguf_arch]
    for hf_name, ours in expand_tensor_names(arch, 2).items():
        want = None if ours == "output.weight" and not has_output else ours
        assert mapping.get_name(hf_name, try_suffixes=(".weight",)) == want, hf_name


def test_gemma_norms_take_the_converters_one_and_give_it_back():
    from llmctl.models.architectures import from_gguf, get_architecture, to_gguf

    gemma, olmo = get_architecture("gemma2"), get_architecture("olmo2")
    w = np.float32([-0.25, 0.0, 0.5])
    name = "model.layers.0.pre_feedforward_layernorm.weight"
    np.testing.assert_array_equal(to_gguf(gemma, name, w, 4, 2), w + 1)
    np.testing.assert_array_equal(from_gguf(gemma, name, w + 1, 4, 2), w)
    np.testing.assert_array_equal(to_gguf(olmo, name, w, 4, 2), w)
    proj = "model.layers.0.mlp.up_proj.weight"
    np.testing.assert_array_equal(to_gguf(gemma, proj, w, 4, 2), w)
