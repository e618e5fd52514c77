"""Engines built once per session from the tiny Llama (seconds for ONNX; the AOTInductor
package compiles C++ with gcc, about 20 s on an idle 2-core machine)."""

from __future__ import annotations

import json
import platform
import shutil
from pathlib import Path

import pytest

PROMPTS = [[5, 17, 33, 99, 100, 7, 8], [5, 17, 33], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]]


def _build(model: Path, target: str, out: Path, **kwargs):
    from llmctl.engines.builder import build_engine
    from llmctl.engines.options import CommonOptions

    options = kwargs.pop("options", {})
    build_engine(str(model), target, out, common=CommonOptions(**kwargs), options=options)
    return out


def incompatible_copy(engine_dir: Path, tmp_path: Path) -> Path:
    """The same engine, as if built on a machine of another architecture."""
    copy = tmp_path / "foreign-engine"
    shutil.copytree(engine_dir, copy)
    manifest = copy / "llmctl-engine.json"
    data = json.loads(manifest.read_text())
    data["requirements"]["arch"] = "aarch64" if platform.machine() != "aarch64" else "x86_64"
    manifest.write_text(json.dumps(data))
    return copy


def _need_onnx() -> None:
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    pytest.importorskip("onnxruntime_genai", reason="the onnx extra is not installed")


@pytest.fixture(scope="session")
def onnx_fp32(tiny_llama, tmp_path_factory) -> Path:
    _need_onnx()
    return _build(tiny_llama, "onnx", tmp_path_factory.mktemp("eng") / "onnx-fp32",
                  precision="fp32")


@pytest.fixture(scope="session")
def onnx_int4(tiny_llama, tmp_path_factory) -> Path:
    _need_onnx()
    return _build(tiny_llama, "onnx", tmp_path_factory.mktemp("eng") / "onnx-int4",
                  precision="int4", options={"block_size": "32"})


@pytest.fixture(scope="session")
def torch_compiled(tiny_llama, tmp_path_factory) -> Path:
    return _build(tiny_llama, "torch-compile", tmp_path_factory.mktemp("eng") / "tc-fp32",
                  precision="fp32", max_seq_len=128, max_batch_size=4,
                  options={"wrapper_opt": "O0"})


@pytest.fixture(scope="session")
def hf_tiny(tiny_llama):
    from llmctl.models.loading import load_model

    return load_model(tiny_llama, "float32")


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def hf_logits(model, ids: list[int]):
    import torch

    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().numpy()
