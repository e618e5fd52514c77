"""Mixture-of-experts GGUF files read back (llmctl.models.gguf_experts): the stacked
``ffn_*_exps`` tensors become per-expert tensors again (gpt-oss's: its fused, interleaved
``x @ W`` tensors, joined from their cuts), the metadata the config fields
llama.cpp's graphs imply, so that transformers runs the imported checkpoint to the
original's logits and the engine serves the .gguf itself (float, and Q8_0 read from each
expert's own bytes)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from llmctl.gguf.export import quantize_to_gguf
from tests.gguf.test_moe_export import VARIANTS

IDS = list(range(3, 43))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (HF model dir, its F32 GGUF), each made once."""
    from tests.tiny import FAMILY_CONFIGS, build_tiny_llama

    root, built = tmp_path_factory.mktemp("gguf-moe-import"), {}

    def get(name: str):
        if name not in built:
            config = json.loads((FAMILY_CONFIGS / f"{name}.json").read_text())
            config.update(VARIANTS[name])
            model = build_tiny_llama(root / name, layers=config.pop("num_hidden_layers"),
                                     **config)
            built[name] = (model, quantize_to_gguf(model, root / f"{name}.gguf", "F32")["path"])
        return built[name]
    return get


def _state(directory):
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def _transformers(directory) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].double()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_f32_import_gives_back_the_experts_and_the_logits(exported, tmp_path, name):
    from llmctl.models.gguf_import import import_gguf

    model, path = exported(name)
    back = import_gguf(path, tmp_path / "imported")
    want, got = _state(model), _state(back)
    # every tensor back bit for bit under its own name (no tensor dropped or invented)
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert torch.equal(got[key].float(), tensor.float()), key
    original = json.loads((model / "config.json").read_text())
    config = json.loads((back / "config.json").read_text())
    for key in ("num_experts", "num_local_experts", "num_experts_per_tok",
                "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob"):
        if key in original:
            assert config[key] == original[key], key
    ref = _transformers(model)
    torch.testing.assert_close(_transformers(back), ref, atol=1e-5 * float(ref.abs().max()),
                               rtol=0)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_the_engine_serves_the_moe_gguf_like_transformers(exported, name):
    from llmctl.serve.engine.llm import LLM
    from tests.serve.model.test_model import engine_logits

    model, path = exported(name)
    llm = LLM(str(path), kv_cache_memory="4MiB", block_size=4)
    assert llm.engine.target.model.spec.num_experts > 0
    got = engine_logits(llm, IDS, 7)
    # the engine's float32 bound against transformers (tests/serve/model/test_moe.py)
    torch.testing.assert_close(got, _transformers(model)[6:].float(), atol=2e-4, rtol=1e-4)


def test_q8_0_experts_are_read_from_their_own_slices(exported, tmp_path):
    """Served natively, each expert of a Q8_0 stack is dequantized from its own bytes:
    the same numbers as gguf-py's dequantization of the whole stack, sliced."""
    import gguf
    from gguf.quants import dequantize

    from llmctl.serve.model.gguf_weights import GGUFWeights

    model, _ = exported("qwen3_moe")
    path = quantize_to_gguf(model, tmp_path / "q8.gguf", "Q8_0")["path"]
    reader = GGUFWeights(path)
    (stack,) = [t for t in gguf.GGUFReader(str(path)).tensors
                if t.name == "blk.1.ffn_down_exps.weight"]
    whole = dequantize(stack.data, stack.tensor_type).reshape(8, 64, 32)
    for e in (0, 5, 7):
        name = f"model.layers.1.mlp.experts.{e}.down_proj.weight"
        assert name in reader
        np.testing.assert_array_equal(reader(name).numpy(), whole[e])
        np.testing.assert_array_equal(reader.layer_weight(name[:-len(".weight")]).numpy(),
                                      whole[e])


def test_a_moe_gguf_of_an_unknown_graph_is_refused_in_one_line(exported, tmp_path):
    """A file that says it has experts where llmctl knows no MoE row for its graph."""
    import gguf

    from llmctl.errors import UnsupportedArchitectureError
    from llmctl.models.gguf_import import import_gguf

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(1)
    writer.add_expert_count(4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitectureError, match="'qwen2' with experts") as caught:
        import_gguf(path, tmp_path / "back")
    assert "\n" not in caught.value.args[0]
    assert not (tmp_path / "back").exists()
