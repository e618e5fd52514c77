"""GGUF written by llmctl -> read back by llmctl and by transformers."""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from llmctl.gguf.writer import export_gguf
from llmctl.models.gguf_import import import_gguf
from llmctl.models.gguf_reader import open_checkpoint, read_metadata


def _state(directory):
    state = {}
    for f in directory.glob("*.safetensors"):
        state.update(load_file(str(f)))
    return state


def test_f32_roundtrip_is_exact(tiny_llama, tiny_gguf, tmp_path):
    out = import_gguf(tiny_gguf, tmp_path / "imported")
    original, imported = _state(tiny_llama), _state(out)
    assert original.keys() == imported.keys()
    for name in original:
        np.testing.assert_array_equal(original[name], imported[name], err_msg=name)
    config = json.loads((out / "config.json").read_text())
    ref = json.loads((tiny_llama / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "vocab_size", "rms_norm_eps"):
        assert config[key] == ref[key], key
    assert config["rope_theta"] == 10000.0


def test_tied_model_roundtrip_has_no_output_tensor(tiny_llama_tied, tmp_path):
    path = export_gguf(tiny_llama_tied, tmp_path / "tied.gguf")
    _, tensors = read_metadata(path)
    assert "output.weight" not in {t.name for t in tensors}
    assert open_checkpoint(path).config["tie_word_embeddings"] is True


def test_transformers_reads_our_gguf_to_the_same_weights(tiny_llama, tiny_gguf):
    """An independent reader (transformers' GGUF loader) agrees, permutation included."""
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    ours = _state(tiny_llama)
    for name, param in theirs.state_dict().items():
        np.testing.assert_allclose(param.numpy(), ours[name], atol=0, rtol=0, err_msg=name)


def test_imported_model_gives_the_same_logits(tiny_llama, tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM

    out = import_gguf(tiny_gguf, tmp_path / "imported")
    ids = torch.tensor([[5, 17, 99, 3, 250, 41]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(str(tiny_llama))(ids).logits
        b = AutoModelForCausalLM.from_pretrained(str(out))(ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0"])
def test_quantized_export_reads_back_within_one_step(tiny_llama, tmp_path, qtype):
    path = export_gguf(tiny_llama, tmp_path / f"t-{qtype}.gguf", qtype)
    original = _state(tiny_llama)
    for name, array in open_checkpoint(path).tensors():
        ref = original[name]
        # Per 32-value block the step is absmax / (levels / 2); use the worst block.
        bound = {"F16": 1e-3, "Q8_0": 1 / 127, "Q4_0": 1 / 7}[qtype] * np.abs(ref).max()
        assert np.abs(array - ref).max() <= bound + 1e-6, name


@pytest.mark.parametrize("gguf_type, step", [("F32", 0.0), ("Q8_0", 1 / 127), ("Q4_1", 1 / 15)])
def test_export_then_resolve_model_gives_back_the_weights(tiny_llama, tmp_path, gguf_type, step):
    """llmctl export -> `resolve_model(FILE.gguf)` (the path every command takes) -> weights."""
    from llmctl.gguf.export import quantize_to_gguf
    from llmctl.models.resolve import resolve_model

    summary = quantize_to_gguf(tiny_llama, tmp_path / f"m-{gguf_type}.gguf", gguf_type)
    resolved = resolve_model(summary["path"])
    assert resolved.source == "gguf"
    original, back = _state(tiny_llama), _state(resolved.path)
    assert original.keys() == back.keys()
    for name, ref in original.items():
        if step == 0.0:
            np.testing.assert_array_equal(back[name], ref, err_msg=name)
        else:
            bound = step * 2 * np.abs(ref).max() + 1e-6  # one step of the widest block
            assert np.abs(back[name] - ref).max() <= bound, name
