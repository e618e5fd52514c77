"""The real model: one ONNX build of SmolLM2-135M, greedy-equal to transformers."""

import pytest

from llmctl.engines.builder import build_engine
from llmctl.engines.engine_dir import open_engine
from llmctl.engines.options import CommonOptions
from tests.engines.conftest import _need_onnx

pytestmark = pytest.mark.slow


def test_smollm2_onnx_fp32_greedy_equals_transformers(smollm2, tmp_path):
    _need_onnx()
    import torch

    from llmctl.models.loading import load_model, load_tokenizer
    from llmctl.models.prompting import encode_prompt

    out = build_engine(str(smollm2), "onnx", tmp_path / "engine",
                       common=CommonOptions(precision="fp32"))
    assert out.source.model_type == "llama"
    engine = open_engine(tmp_path / "engine", threads=2)
    tok = load_tokenizer(smollm2)
    ids = encode_prompt(tok, "What is the capital of France?", chat=True)
    got = engine.generate(ids, max_tokens=32, ignore_eos=True)
    model = load_model(smollm2, "float32")
    # no EOS for transformers either (min_new_tokens would mask EOS out of the argmax)
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                             pad_token_id=2)[0, len(ids):].tolist()
    assert len(got) == 32 and got == ref
    assert tok.decode(got).startswith("The capital of France is Paris.")
