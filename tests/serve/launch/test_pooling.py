"""/v1/embeddings' pooling at launch (llmctl.serve.launch.pooling): --pooling, else the
checkpoint's sentence-transformers config, else last."""

import json
import logging

import pytest

from llmctl.errors import UsageError
from llmctl.serve.launch.pooling import model_pooling, resolve_pooling


def _sentence_transformers(root, **modes):
    (root / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (root / "1_Pooling").mkdir()
    config = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
              "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": False, **modes}
    (root / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize(("modes", "want"), [
    ({"pooling_mode_lasttoken": True}, "last"), ({"pooling_mode_mean_tokens": True}, "mean")])
def test_the_models_own_pooling(tmp_path, modes, want):
    root = _sentence_transformers(tmp_path, **modes)
    assert model_pooling(root) == want
    assert resolve_pooling(None, root) == want
    assert resolve_pooling("last" if want == "mean" else "mean", root) != want  # the flag wins


def test_no_config_or_an_unknown_mode_is_last(tmp_path, caplog):
    assert resolve_pooling(None, tmp_path) == "last"
    assert resolve_pooling(None, None) == "last"
    (tmp_path / "cls").mkdir()
    root = _sentence_transformers(tmp_path / "cls", pooling_mode_cls_token=True)
    with caplog.at_level(logging.WARNING, logger="llmctl.serve"):
        assert resolve_pooling(None, root) == "last"
    assert "pooling_mode_cls_token" in caplog.text


def test_an_unknown_flag_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown --pooling 'cls'"):
        resolve_pooling("cls", None)


@pytest.mark.parametrize("engine", ["vllm", "trtllm"])
@pytest.mark.parametrize("flag", ["--pooling", "--embed-normalize"])
def test_hand_off_engines_refuse_the_embedding_flags(engine, flag):
    from llmctl.serve.handoff.engines import refuse_unsupported

    with pytest.raises(UsageError, match=f"does not support {flag}"):
        refuse_unsupported(engine, {flag: "mean"})
