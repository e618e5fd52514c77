"""A compressed-tensors checkpoint (what `llmctl quantize` writes) as the build source."""

import json
import shutil

import pytest

from llmctl.engines.builder import build_engine
from llmctl.engines.engine_dir import open_engine
from llmctl.engines.manifest import read_manifest
from tests.engines.conftest import PROMPTS, _need_onnx, hf_greedy

GROUP = 32


@pytest.fixture(scope="module")
def w4_checkpoint(tiny_llama, tmp_path_factory):
    """Symmetric int4, group 32, pack-quantized; and the float model it stands for."""
    import torch
    from safetensors.torch import load_file, save_file

    from llmctl.models.loading import load_model
    from llmctl.quant.packing import pack_int32

    out = tmp_path_factory.mktemp("w4") / "tiny-w4"
    shutil.copytree(tiny_llama, out)
    tensors = load_file(str(out / "model.safetensors"))
    dequantized = {}
    for name in list(tensors):
        if not (name.endswith("_proj.weight") and ".layers." in name):
            continue
        w = tensors.pop(name)
        n, k = w.shape
        groups = w.view(n, k // GROUP, GROUP)
        scale = groups.abs().amax(-1, keepdim=True) / 7
        q = torch.clamp(torch.round(groups / scale), -8, 7)
        layer = name[: -len(".weight")]
        tensors[f"{layer}.weight_packed"] = pack_int32(q.view(n, k).to(torch.int8), 4)
        tensors[f"{layer}.weight_scale"] = scale.view(n, -1).contiguous()
        tensors[f"{layer}.weight_shape"] = torch.tensor([n, k])
        dequantized[name] = (q * scale).view(n, k)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
            "group_size": GROUP, "dynamic": False}}}}
    (out / "config.json").write_text(json.dumps(config))
    model = load_model(tiny_llama, "float32")
    state = model.state_dict()
    state.update(dequantized)
    model.load_state_dict(state)
    return out, model


def test_onnx_from_w4_checkpoint_equals_the_dequantized_model(w4_checkpoint, tmp_path):
    _need_onnx()
    path, model = w4_checkpoint
    build_engine(str(path), "onnx", tmp_path / "engine")
    manifest = read_manifest(tmp_path / "engine")
    assert manifest.source.quantization == "compressed-tensors:pack-quantized W4 group g32 sym"
    assert any("dequantized" in note for note in manifest.notes)
    assert "quantization_config" not in json.loads((tmp_path / "engine" / "config.json")
                                                   .read_text())
    engine = open_engine(tmp_path / "engine", threads=1)
    outs = engine.generate(PROMPTS, max_tokens=32, ignore_eos=True)
    for prompt, out in zip(PROMPTS, outs):
        assert out == hf_greedy(model, prompt, 32)
