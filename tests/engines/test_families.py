"""``build-engine`` for every family llmctl runs, against transformers in float32.

The models are the tiny random checkpoints of ``tests/data/families/`` (each with its
family's features on: soft-caps, (1 + w) norms, sandwich and post norms, q/k norms per
head and per projection, multipliers, Gemma 3's local RoPE, LongRoPE with partial rotary,
Phi-3's fused projections, sliding windows of 8 and 16). Tolerance: every logit within
1e-4 (absolute and relative) of transformers', on a 40-token sequence, past every window
and past Phi-3's LongRoPE switch at 32 (both sides use the long factors).

- The static decoder (what torch.export traces) for every family, eagerly: a 30-token
  prefill, then 10 tokens through its cache.
- torch.compile (AOTInductor): Gemma 3 and Phi-3, the two whose graphs differ most from
  Llama's (two RoPE tables, q/k norms, windows; fused weights, partial LongRoPE); a
  package costs about a minute of gcc on 2 cores. The other families' graphs are the same
  module checked eagerly above.
- ONNX (onnxruntime-genai's builder): the families its graph computes right are built and
  checked; the others are refused with one line naming the family, exit 2.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from llmctl.cli.app import build_app
from tests.engines.conftest import _build, _need_onnx
from tests.tiny import FAMILY_NAMES

IDS = list(range(5, 45))  # 40 tokens: past the windows (8, 16) and LongRoPE's 32
TOL = {"atol": 1e-4, "rtol": 1e-4}
ONNX_BUILT = ["gemma", "granite", "llama31"]
ONNX_REFUSED = {"gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3", "olmo2": "olmo2"}


def _hf_logits(path) -> np.ndarray:
    from llmctl.models.loading import load_model

    with torch.inference_mode():
        return load_model(path, "float32")(torch.tensor([IDS])).logits[0].float().numpy()


def _chunked(forward) -> np.ndarray:
    """Logits of IDS as a 30-token prefill and a 10-token chunk over its cache."""
    first = forward(IDS[:30], 0)
    return np.concatenate([first, forward(IDS[30:], 30)])


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_static_decoder_equals_transformers(tiny_family, name):
    from llmctl.engines.static_decoder import build_static_decoder

    path = tiny_family(name)
    decoder, spec = build_static_decoder(path, torch.float32, 64)
    shape = (spec.num_layers, 1, spec.num_kv_heads, 1, spec.head_dim)
    cache = {"k": torch.zeros(shape), "v": torch.zeros(shape)}

    def forward(ids, start):
        with torch.inference_mode():
            logits, k, v = decoder(torch.tensor([ids]), torch.tensor([start]), cache["k"],
                                   cache["v"])
        if start == 0:
            cache["k"], cache["v"] = k, v
        return logits[0].numpy()

    np.testing.assert_allclose(_chunked(forward), _hf_logits(path), **TOL)


def test_static_decoder_windows_a_mistral_past_its_window(tmp_path):
    """Mistral's window covers every layer (8 here; 40 tokens): the masks, not a refusal."""
    from llmctl.engines.static_decoder import build_static_decoder
    from tests.tiny import build_tiny_llama

    path = build_tiny_llama(tmp_path / "mistral", model_type="mistral", sliding_window=8,
                            head_dim=16)
    decoder, spec = build_static_decoder(path, torch.float32, 64)
    assert spec.layer_windows == (8, 8)
    empty = torch.zeros(spec.num_layers, 1, spec.num_kv_heads, 1, spec.head_dim)
    with torch.inference_mode():
        got = decoder(torch.tensor([IDS]), torch.tensor([0]), empty, empty)[0][0].numpy()
    np.testing.assert_allclose(got, _hf_logits(path), **TOL)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_static_decoder_in_bfloat16_stays_close(tiny_family, name):
    """bf16 weights and activations (what ``--precision bf16`` traces) against float32
    transformers: every logit within 0.35, the serving engine's bf16 bound."""
    from llmctl.engines.static_decoder import build_static_decoder

    path = tiny_family(name)
    decoder, spec = build_static_decoder(path, torch.bfloat16, 64)
    empty = torch.zeros(spec.num_layers, 1, spec.num_kv_heads, 1, spec.head_dim,
                        dtype=torch.bfloat16)
    with torch.inference_mode():
        got = decoder(torch.tensor([IDS]), torch.tensor([0]), empty, empty)[0][0].numpy()
    np.testing.assert_allclose(got, _hf_logits(path), atol=0.35, rtol=0)


@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_torch_compile_package_equals_transformers(tiny_family, tmp_path, name):
    from llmctl.engines.engine_dir import open_engine
    from tests.engines.conftest import hf_greedy

    path = tiny_family(name)
    engine = open_engine(_build(path, "torch-compile", tmp_path / name, precision="fp32",
                                max_seq_len=64, max_batch_size=2,
                                options={"wrapper_opt": "O0"}), threads=1)
    rt = engine.runtime
    state = rt.new_state()
    got = _chunked(lambda ids, start: rt.forward([state], [ids], all_logits=True)[0])
    np.testing.assert_allclose(got, _hf_logits(path), **TOL)
    from llmctl.models.loading import load_model

    want = hf_greedy(load_model(path, "float32"), IDS, 8)
    assert engine.generate([IDS], max_tokens=8, ignore_eos=True)[0] == want


@pytest.mark.parametrize("name", [*ONNX_BUILT, "qwen3"])
def test_onnx_engine_equals_transformers(tiny_family, tmp_path, name):
    _need_onnx()
    from llmctl.engines.engine_dir import open_engine
    from tests.tiny import build_tiny_llama

    path = (build_tiny_llama(tmp_path / "qwen3", model_type="qwen3", head_dim=16)
            if name == "qwen3" else tiny_family(name))
    engine = open_engine(_build(path, "onnx", tmp_path / "engine", precision="fp32"), threads=1)
    rt = engine.runtime
    state = rt.new_state()
    got = _chunked(lambda ids, start: rt.forward([state], [ids], all_logits=True)[0])
    np.testing.assert_allclose(got, _hf_logits(path), **TOL)


@pytest.mark.parametrize("name", sorted(ONNX_REFUSED))
def test_onnx_refuses_the_families_its_graph_cannot_run(tiny_family, tmp_path, name):
    path = tiny_family(name)
    out = tmp_path / "engine"
    result = CliRunner().invoke(build_app(), ["build-engine", str(path), "--target", "onnx",
                                              "-o", str(out)])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"does not build {ONNX_REFUSED[name]} models" in errors[0]
    assert "Traceback" not in result.output and not out.exists()


def test_an_unknown_family_is_refused_naming_the_supported_ones(tiny_family, tmp_path):
    src = tmp_path / "falcon"
    src.mkdir()
    config = json.loads((tiny_family("granite") / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "falcon"}))
    result = CliRunner().invoke(build_app(), ["build-engine", str(src), "--target",
                                              "torch-compile", "-o", str(tmp_path / "e")])
    assert result.exit_code == 1, result.output
    assert "'falcon' is not supported" in result.output
    assert "gemma2" in result.output and "docs/architecture.md" in result.output
    assert "Traceback" not in result.output
