"""Importance matrices: the statistic, llama.cpp's file format, and their effect."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmctl.gguf.imatrix import Imatrix, ImatrixEntry, collect, load_imatrix, save_imatrix


@pytest.fixture(scope="module")
def tiny_imatrix(tiny_llama_256):
    from llmctl.gguf.imatrix import compute_imatrix

    return compute_imatrix(tiny_llama_256, "builtin:pydoc-calib", samples=4, seq_len=64)


def test_entries_are_mean_squared_inputs_of_each_linear(tiny_llama_256, tiny_imatrix):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_256), dtype=torch.float32)
    layer = model.model.layers[1]
    ids = torch.tensor([list(range(5, 69))])
    with torch.inference_mode():
        hidden = model(ids, output_hidden_states=True).hidden_states[1]  # input of layer 1
        normed = layer.input_layernorm(hidden)[0].double()
    names = {"model.layers.1.self_attn.q_proj.weight": "blk.1.attn_q.weight",
             "model.layers.1.self_attn.k_proj.weight": "blk.1.attn_k.weight"}
    entries = collect(model, [ids[0].tolist()], names)
    expected = (normed ** 2).mean(0).numpy()
    for name in names.values():
        assert entries[name].count == 64
        np.testing.assert_allclose(entries[name].values(), expected, rtol=1e-5)
    # every decoder linear has an entry, keyed by its GGUF name; the head has none
    assert len(tiny_imatrix.entries) == 2 * 7 and "output.weight" not in tiny_imatrix.entries
    assert tiny_imatrix.entries["blk.0.ffn_down.weight"].sums.shape == (512,)
    assert tiny_imatrix.chunk_count == 4 and tiny_imatrix.chunk_size == 64


def test_gguf_imatrix_file_has_llama_cpp_layout(tiny_imatrix, tmp_path):
    import gguf

    path = save_imatrix(tiny_imatrix, tmp_path / "imatrix.gguf")
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.type"].contents() == "imatrix"
    assert reader.fields["imatrix.datasets"].contents() == ["builtin:pydoc-calib"]
    assert reader.fields["imatrix.chunk_count"].contents() == 4
    assert reader.fields["imatrix.chunk_size"].contents() == 64
    assert "general.architecture" not in reader.fields
    tensors = {t.name: t for t in reader.tensors}
    sums, counts = tensors["blk.0.attn_q.weight.in_sum2"], tensors["blk.0.attn_q.weight.counts"]
    assert sums.tensor_type.name == counts.tensor_type.name == "F32"
    assert list(sums.shape) == [256, 1] and list(counts.shape) == [1, 1]  # ggml ne order
    loaded = load_imatrix(path)
    for name, entry in tiny_imatrix.entries.items():
        assert loaded.entries[name].count == entry.count
        np.testing.assert_allclose(loaded.values()[name], entry.values(), rtol=1e-6)


def test_legacy_dat_imatrix_is_read(tmp_path):
    import struct

    values = np.array([1.0, 4.0, 9.0], dtype=np.float32)
    name = b"blk.0.attn_q.weight"
    ncall = 10  # legacy files store mean * ncall
    blob = struct.pack("<i", 1) + struct.pack("<i", len(name)) + name
    blob += struct.pack("<ii", ncall, 3) + (values * ncall).tobytes()
    blob += struct.pack("<i", 10) + struct.pack("<i", 4) + b"data"
    path = tmp_path / "imatrix.dat"
    path.write_bytes(blob)
    loaded = load_imatrix(path)
    np.testing.assert_allclose(loaded.values()["blk.0.attn_q.weight"], values)
    assert loaded.datasets == ["data"] and loaded.chunk_count == 10


def test_imatrix_lowers_the_weighted_error_llama_cpp_minimises(llama_cpp, tiny_llama_256,
                                                               tiny_imatrix, tmp_path):
    """With the matrix, llama.cpp trades error on unimportant columns for error on
    important ones: sum_j imatrix_j (w - q)_j^2 drops. A misaligned matrix would not."""
    from safetensors.numpy import load_file

    from llmctl.gguf.export import quantize_to_gguf
    from llmctl.models.architectures import expand_tensor_names, get_architecture
    from llmctl.models.gguf_reader import open_checkpoint

    file = save_imatrix(tiny_imatrix, tmp_path / "imatrix.gguf")
    plain = quantize_to_gguf(tiny_llama_256, tmp_path / "plain.gguf", "IQ4_XS")
    weighted = quantize_to_gguf(tiny_llama_256, tmp_path / "imat.gguf", "IQ4_XS", imatrix=file)
    assert weighted["imatrix"]["entries"] == 14
    original = load_file(str(tiny_llama_256 / "model.safetensors"))
    to_gguf = expand_tensor_names(get_architecture("llama"), 2)
    values = tiny_imatrix.values()

    def weighted_error(path):
        out = {}
        for hf_name, w in open_checkpoint(path).tensors():
            name = to_gguf[hf_name]
            if name in values:
                out[name] = float((values[name] * (w - original[hf_name]) ** 2).sum())
        return out

    a, b = weighted_error(plain["path"]), weighted_error(weighted["path"])
    better = sum(b[n] < a[n] for n in a)
    assert better >= len(a) - 1, (a, b)
    assert sum(b.values()) < 0.97 * sum(a.values())


def test_empty_or_damaged_imatrix_files_are_refused(tmp_path):
    from llmctl.errors import GGUFError

    (tmp_path / "bad.dat").write_bytes(b"\x01\x00")
    with pytest.raises(GGUFError, match="ends early"):
        load_imatrix(tmp_path / "bad.dat")
    with pytest.raises(GGUFError, match="no imatrix file"):
        load_imatrix(tmp_path / "missing.gguf")


def test_values_of_an_entry_without_tokens_are_ones():
    entry = ImatrixEntry(np.zeros(4), 0)
    np.testing.assert_array_equal(entry.values(), np.ones(4, np.float32))
    assert Imatrix({"a": entry}, [], 0, 0).describe()["entries"] == 1
