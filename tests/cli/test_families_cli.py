"""The CLI across families: ``info``, ``plan`` and ``generate`` on the tiny Gemma 2 (sandwich
norms, soft-caps, windows of 8), Phi-3 (fused projections, LongRoPE with half the head
rotated, a window of 16) and OLMo 2 (post-norms, whole-projection q/k norms) checkpoints;
an unknown model type is one error (and its hint) naming the families and
docs/architecture.md, exit 1 as README's "Errors" says, no traceback."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llmctl.cli.app import build_app

runner = CliRunner()
app = build_app()
FAMILIES = ["gemma2", "phi3", "olmo2"]
# > 32 tokens: Phi-3's LongRoPE uses its long factors on both sides (see
# tests/serve/model/test_families.py)
PROMPT = ("The file object returned by open() is an iterator over the lines of the file; "
          "each line ends with a newline character unless it is the last one, and the "
          "mode says whether it is read as text or bytes.")
# name -> (window pattern, KV bytes per bf16 token, KV of one 512-token sequence):
# 4 layers x 2 KV heads x 16 dims x 2 (K, V) x 2 bytes = 128 B per layer-token
EXPECTED = {"gemma2": ("SFSF", 512, (2 * 8 + 2 * 512) * 128),
            "phi3": ("SSSS", 512, 4 * 16 * 128),
            "olmo2": (None, 512, 4 * 512 * 128)}


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("name", FAMILIES)
def test_info(tiny_family, name):
    result = run("info", tiny_family(name), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    pattern, per_token, _ = EXPECTED[name]
    assert data["features"]["window_pattern"] == pattern
    assert data["footprint"]["kv_bytes_per_token"] == per_token
    assert data["footprint"]["parameters"] == data["parameters"]
    human = run("info", tiny_family(name))
    assert human.exit_code == 0 and "KV per token" in human.output
    assert "norms" in human.output


@pytest.mark.parametrize("name", FAMILIES)
def test_plan(tiny_family, name):
    result = run("plan", tiny_family(name), "-H", "l4", "--context", 512, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    _, _, at_512 = EXPECTED[name]
    assert data["memory"]["kv_bytes_per_token"] == at_512 / 512
    assert data["fits"] is True
    assert data["model"]["total_params"] == json.loads(
        run("info", tiny_family(name), "--json").stdout)["parameters"]
    if name == "gemma2":
        human = run("plan", tiny_family(name), "-H", "l4", "--context", 512)
        assert human.exit_code == 0, human.output
        assert "2 of 4 layers" in human.output and "hold at most 8" in human.output


def _hf_greedy(path, ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, one full forward per token: ``generate`` would
    torch.compile Gemma 2's hybrid cache first (minutes on 2 cores)."""
    import torch

    from llmctl.models.loading import load_model

    model, out = load_model(path, "float32"), list(ids)
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


@pytest.mark.parametrize("name", FAMILIES)
def test_generate_equals_transformers_greedy(tiny_family, name):
    from llmctl.models.loading import load_tokenizer

    path = tiny_family(name)
    ids = load_tokenizer(path)(PROMPT)["input_ids"]
    assert len(ids) > 32
    expected = _hf_greedy(path, ids, 8)
    result = run("generate", path, "--prompt", PROMPT, "--max-tokens", 8, "--dtype",
                 "float32", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["token_ids"] == expected


@pytest.mark.parametrize("command", [["info"], ["plan", "-H", "l4"],
                                     ["generate", "--prompt", "hi", "--max-tokens", "2"]])
def test_an_unknown_model_type_is_one_error_naming_the_families(tiny_family, tmp_path,
                                                                command):
    config = json.loads((tiny_family("olmo2") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "falcon"}))
    result = run(command[0], tmp_path, *command[1:])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert lines[0] == "error: model type 'falcon' is not supported" or \
        lines[0] == "error: model type 'falcon' is not one llmctl can cost"
    assert len(lines) == 2 and lines[1].lstrip().startswith("hint:")
    for needed in ("gemma2", "phi3", "olmo2", "docs/architecture.md"):
        assert needed in lines[1]
    assert "Traceback" not in result.output
