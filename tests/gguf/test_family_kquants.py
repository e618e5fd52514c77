"""K-quant and i-quant GGUF files of the new families, made by llama.cpp's quantizer, read
back by llmctl: tensors bit-exact with gguf-py's dequantization, the file's tokenizer and
chat template kept, llama.cpp running what llmctl reads, the engine serving the file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from llmctl.eval.metrics import dense_position_stats
from llmctl.gguf.export import quantize_to_gguf
from tests.gguf.conftest import TOKENIZER_STRINGS

TYPES = ["Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS"]
IDS = list(range(3, 43))
# rows of 256 (hidden) and 512 (MLP): every K-quant block fits, nothing falls back
WIDE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


@pytest.fixture(scope="module")
def wide_models(gguf_family):
    """Gemma 3 (norms stored as w + 1, q/k norms, sandwich norms) and Phi-3 (fused
    attn_qkv / ffn_up, LongRoPE factors over a partial rotary of 32 dims)."""
    half = 16  # factors: half of the rotated 64 * 0.5 dims
    return {
        "gemma3": gguf_family("gemma3", query_pre_attn_scalar=64, **WIDE),
        "phi3": gguf_family("phi3", **WIDE, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": np.linspace(1, 2, half).tolist(),
            "long_factor": np.linspace(1, 4, half).tolist()}),
    }


@pytest.fixture(scope="module")
def quantized(llama_cpp, wide_models, tmp_path_factory):
    """(family, type) -> (GGUF path, its llmctl import); built on first use."""
    from llmctl.models.gguf_import import import_gguf

    root = tmp_path_factory.mktemp("family-kquants")
    made: dict = {}

    def get(name: str, gguf_type: str):
        if (name, gguf_type) not in made:
            summary = quantize_to_gguf(wide_models[name], root / f"{name}-{gguf_type}.gguf",
                                       gguf_type)
            assert summary["fallbacks"] == [] and summary["engine"] == "llama.cpp"
            back = import_gguf(summary["path"], root / f"{name}-{gguf_type}")
            made[name, gguf_type] = summary["path"], back
        return made[name, gguf_type]

    return get


def _expected(path, name: str) -> dict[str, np.ndarray]:
    """gguf-py's dequantization of every tensor, in GGUF names and order."""
    import gguf

    out = {}
    for t in gguf.GGUFReader(path).tensors:
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        out[t.name] = np.asarray(array, dtype=np.float32).reshape(
            tuple(int(d) for d in reversed(t.shape)))
    return out


@pytest.mark.parametrize("name, gguf_type",
                         [("gemma3", t) for t in TYPES] + [("phi3", "Q4_K_M")])
def test_import_is_gguf_py_dequantization_bit_for_bit(quantized, name, gguf_type):
    from llmctl.models.architectures import expand_tensor_names, get_architecture
    from llmctl.models.gguf_reader import read_metadata

    path, back = quantized(name, gguf_type)
    assert gguf_type.removesuffix("_M") in {t.type for t in read_metadata(path)[1]}
    model_type = "gemma3_text" if name == "gemma3" else name
    names = expand_tensor_names(get_architecture(model_type), 4)
    want, got = _expected(path, name), load_file(str(back / "model.safetensors"))
    generated = {"rope_factors_long.weight", "rope_factors_short.weight"}
    assert {names[k] for k in got} == set(want) - generated
    for hf_name, array in got.items():
        expected = want[names[hf_name]]
        if name == "gemma3" and hf_name.endswith("norm.weight"):
            expected = expected - np.float32(1.0)  # llama.cpp's converter stored w + 1
        np.testing.assert_array_equal(array, expected, err_msg=hf_name)


def test_the_files_tokenizer_and_chat_template_are_kept(quantized, wide_models):
    from transformers import AutoTokenizer

    _, back = quantized("phi3", "Q4_K_M")
    ours = AutoTokenizer.from_pretrained(str(back))
    theirs = AutoTokenizer.from_pretrained(str(wide_models["phi3"]))
    for text in TOKENIZER_STRINGS:
        assert ours.encode(text, add_special_tokens=False) == \
            theirs.encode(text, add_special_tokens=False), text
    assert ours.chat_template == theirs.chat_template
    assert ours.eos_token == theirs.eos_token


def _kld(p: np.ndarray, q: np.ndarray) -> float:
    return float(dense_position_stats(p[:-1], q[:-1], np.asarray(IDS[1:])).kld.mean())


@pytest.mark.parametrize("name, gguf_type",
                         [("gemma3", t) for t in TYPES] + [("phi3", "Q4_K_M")])
def test_llama_cpp_runs_what_llmctl_reads(quantized, wide_models, name, gguf_type):
    """llama.cpp's logits on the quantized file are nearer (in KL, 4x) to transformers on
    llmctl's import of that file than to the float model: both run the same quantized
    weights; llama.cpp rounds activations to Q8_K on top (and Gemma's GeLU to fp16)."""
    from llmctl.gguf.compare import llamacpp_logits, transformers_logits

    path, back = quantized(name, gguf_type)
    cpp = llamacpp_logits(path, [IDS])[0]
    imported = transformers_logits(back, [IDS])[0]
    float_ref = transformers_logits(wide_models[name], [IDS])[0]
    assert np.isfinite(cpp).all()
    assert _kld(imported, cpp) < 0.25 * _kld(float_ref, cpp), (
        _kld(imported, cpp), _kld(float_ref, cpp))


@pytest.mark.parametrize("name, gguf_type", [("gemma3", "IQ4_XS"), ("phi3", "Q4_K_M")])
def test_engine_serves_the_quantized_file_like_its_import(quantized, name, gguf_type):
    """K-/i-quant tensors are dequantized once at load: the engine then runs the imported
    model's float weights (its bound against transformers, tests/serve/model)."""
    from llmctl.serve.engine.llm import LLM
    from tests.serve.model.test_model import engine_logits, hf_logits

    path, back = quantized(name, gguf_type)
    llm = LLM(str(path), kv_cache_memory="4MiB", block_size=4)
    got = engine_logits(llm, IDS, 7)
    torch.testing.assert_close(got, hf_logits(back, IDS)[6:], atol=2e-4, rtol=1e-4)


def test_a_type_gguf_py_cannot_read_is_named(quantized, monkeypatch):
    """gguf-py 0.19 has no dequantizer for Q8_1, Q8_K (llama.cpp's activation types) and
    Q1_0; a file holding one must fail with the type's name, not a traceback."""
    import gguf

    from llmctl.errors import GGUFError
    from llmctl.models.gguf_reader import read_metadata
    from llmctl.serve.model.gguf_weights import GGUFWeights

    path, _ = quantized("phi3", "Q4_K_M")
    kind = {t.name: t.type for t in read_metadata(path)[1]}["blk.0.attn_qkv.weight"]
    real = gguf.quants.dequantize

    def unreadable(data, qtype):
        if qtype.name == kind:
            raise NotImplementedError(kind)
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", unreadable)
    weights = GGUFWeights(path)
    with pytest.raises(GGUFError, match=f"is {kind}, which gguf-py cannot dequantize"):
        weights("model.layers.0.self_attn.qkv_proj.weight")
