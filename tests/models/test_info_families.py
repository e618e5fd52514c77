"""``llmctl info``'s family features: the tiny checkpoints of every family (their weights'
parameter count equals the count from config.json, tied or not) and the published configs
of Gemma-2-2B, Gemma-3-1B, Phi-4-mini, Granite-3.1-2B and OLMo-2-1B
(tests/perf/test_families.py)."""

from __future__ import annotations

import json

import pytest

from llmctl.errors import UnsupportedArchitectureError
from llmctl.models.info import features, model_info, window_pattern
from llmctl.models.spec import ModelArch
from llmctl.perf.footprint import footprint
from tests.perf.test_families import REAL
from tests.tiny import FAMILY_NAMES


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_weights_and_config_count_the_same_parameters(tiny_family, name):
    path = tiny_family(name)
    info = model_info(path)
    assert info.parameters == footprint(json.loads((path / "config.json").read_text())
                                        ).parameters


def test_tiny_features(tiny_family):
    g2 = model_info(tiny_family("gemma2")).features
    assert (g2["norms"], g2["norm_offset"], g2["activation"]) == ("sandwich", 1.0,
                                                                 "gelu_pytorch_tanh")
    assert g2["attention_scale"] == pytest.approx(24 ** -0.5)
    assert (g2["attn_softcap"], g2["final_softcap"]) == (2.0, 5.0)
    assert (g2["sliding_windows"], g2["window_pattern"]) == ([8], "SFSF")
    assert g2["embedding_multiplier"] == pytest.approx(8.0)  # sqrt(64)
    g3 = model_info(tiny_family("gemma3")).features
    assert (g3["qk_norm"], g3["window_pattern"]) == ("head", "SSFS")
    assert g3["rope"] == {"type": "linear", "theta": 1e6, "factor": 4.0}
    assert g3["local_rope"] == {"type": "default", "theta": 10000.0}
    phi = model_info(tiny_family("phi3")).features
    assert phi["rope"]["type"] == "longrope" and phi["partial_rotary_factor"] == 0.5
    assert phi["rope"]["original_max_position_embeddings"] == 32
    assert phi["fused_projections"] == ["self_attn.qkv_proj", "mlp.gate_up_proj"]
    assert phi["window_pattern"] == "SSSS"
    olmo = model_info(tiny_family("olmo2")).features
    assert (olmo["norms"], olmo["qk_norm"], olmo["window_pattern"]) == ("post", "projection",
                                                                        None)
    granite = model_info(tiny_family("granite")).features
    assert granite["attention_scale"] == 0.3
    assert (granite["embedding_multiplier"], granite["residual_multiplier"],
            granite["logits_scaling"]) == (12.0, 0.22, 8.0)


def test_published_configs_features():
    f = {name: features(ModelArch.from_config(cfg)) for name, cfg in REAL.items()}
    assert f["gemma2-2b"]["window_pattern"] == "SF" * 13
    assert (f["gemma2-2b"]["attn_softcap"], f["gemma2-2b"]["final_softcap"]) == (50.0, 30.0)
    assert f["gemma2-2b"]["attention_scale"] is None  # query_pre_attn_scalar = head_dim
    assert f["gemma3-1b"]["window_pattern"] == ("SSSSSF" * 5)[:26]
    assert f["gemma3-1b"]["sliding_windows"] == [512]
    assert f["gemma3-1b"]["local_rope"] == {"type": "default", "theta": 10000.0}
    assert f["gemma3-1b"]["attn_softcap"] is None
    assert f["phi4-mini"]["partial_rotary_factor"] == 0.75
    assert f["phi4-mini"]["rope"]["original_max_position_embeddings"] == 4096
    assert f["granite3.1-2b"]["attention_scale"] == 0.015625
    assert f["olmo2-1b"]["qk_norm"] == "projection"


def test_window_pattern():
    assert window_pattern((None, None)) is None and window_pattern(()) is None
    assert window_pattern((4, None, 4)) == "SFS"


def test_an_unknown_type_names_the_families_and_the_doc(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon",
                                                      "vocab_size": 8, "hidden_size": 8}))
    with pytest.raises(UnsupportedArchitectureError) as err:
        model_info(tmp_path)
    assert "'falcon'" in str(err.value) and "gemma2" in str(err.value)
    assert "docs/architecture.md" in str(err.value)
