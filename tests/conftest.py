from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]  # tests/test_collection.py runs pytest on made-up files

# Test files whose collection produced at least one test in this session (nodeids such as
# "tests/cli/test_cli.py"), for tests/test_collection.py: a session that collects the whole
# suite answers its "is every file collected?" without collecting it again in a subprocess.
COLLECTED_FILES: set[str] = set()


def pytest_collectreport(report):
    if report.passed and report.nodeid.endswith(".py") and report.result:
        COLLECTED_FILES.add(report.nodeid)


@pytest.fixture(scope="session", autouse=True)
def _llmctl_home(tmp_path_factory):
    """Tests never touch the user's cache: one fresh LLMCTL_HOME per session."""
    home = tmp_path_factory.mktemp("llmctl-home")
    old = os.environ.get("LLMCTL_HOME")
    os.environ["LLMCTL_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("LLMCTL_HOME", None)
    else:
        os.environ["LLMCTL_HOME"] = old


@pytest.fixture(autouse=True)
def _torch_threads():
    """Engines and eval runs set torch's process-wide thread count; put it back after each
    test so no test inherits another's setting."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """``make(name)``: the tiny random checkpoint of ``tests/data/families/<name>.json``
    (tests.tiny.FAMILY_NAMES), built once per session."""
    from tests.tiny import build_family

    root = tmp_path_factory.mktemp("tiny-families")
    built: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in built:
            built[name] = build_family(root / name, name)
        return built[name]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    from tests.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory) -> Path:
    from tests.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama-tied", tie=True, seed=1)


@pytest.fixture(scope="session")
def tiny_loras(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    """Three random PEFT adapters on the tiny llama: every projection (r=4), a subset with
    rsLoRA (r=8), attention of one layer only (r=8): name -> adapter directory."""
    from tests.lora_adapters import build_adapter

    root = tmp_path_factory.mktemp("loras")
    return {
        "all4": build_adapter(tiny_llama, root / "all4", rank=4, alpha=8, seed=1),
        "some8": build_adapter(tiny_llama, root / "some8", rank=8, alpha=4, seed=2,
                               targets=["q_proj", "v_proj", "down_proj"], use_rslora=True),
        "attn1": build_adapter(tiny_llama, root / "attn1", rank=8, alpha=16, seed=3,
                               targets=["q_proj", "k_proj", "v_proj", "o_proj"],
                               layers_to_transform=[1]),
    }


@pytest.fixture(scope="session")
def tiny_near_draft(tiny_llama, tmp_path_factory) -> Path:
    """tiny_llama with noise on its weights: a draft that agrees often, not always."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("near-draft") / "near"
    shutil.copytree(tiny_llama, out)
    weights = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    noisy = {k: (v + 0.06 * torch.randn(v.shape, generator=gen) if v.ndim == 2 else v)
             for k, v in weights.items()}
    save_file(noisy, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def tiny_gguf(tiny_llama, tmp_path_factory) -> Path:
    from llmctl.gguf.writer import export_gguf

    return export_gguf(tiny_llama, tmp_path_factory.mktemp("gguf") / "tiny.gguf", "F32")


@pytest.fixture(scope="session")
def smollm2(_llmctl_home) -> Path:
    """The embedded SmolLM2-135M-Instruct, converted once per test session."""
    from llmctl.models.resolve import resolve_model

    return resolve_model("smollm2-135m").path


@pytest.fixture(scope="session")
def smollm2_quants(smollm2, tmp_path_factory):
    """SmolLM2 quantized by every scheme the quality tests compare, each quantized and
    scored against the float model once per session (tests/smollm2_quant.py)."""
    from tests.smollm2_quant import SmolLM2Quants

    return SmolLM2Quants(smollm2, tmp_path_factory.mktemp("smollm2-quant"))
