import json
import shutil

import pytest

from llmctl.errors import (
    GGUFError,
    ModelNotFoundError,
    NotAModelError,
    OfflineError,
    UnsupportedArchitectureError,
)
from llmctl.models import gguf_import, resolve
from llmctl.models.info import model_info
from llmctl.models.resolve import resolve_model


def test_local_directory_resolves_to_itself(tiny_llama):
    resolved = resolve_model(str(tiny_llama))
    assert resolved.source == "local"
    assert resolved.path == tiny_llama.resolve()


def test_gguf_is_imported_once_then_served_from_cache(tiny_gguf, monkeypatch):
    first = resolve_model(str(tiny_gguf))
    assert first.source == "gguf" and (first.path / "model.safetensors").is_file()
    calls = []
    monkeypatch.setattr(resolve, "import_gguf",
                        lambda *a, **k: calls.append(a) or gguf_import.import_gguf(*a, **k))
    weights = first.path / "model.safetensors"
    written = weights.stat().st_mtime_ns
    second = resolve_model(str(tiny_gguf))
    assert second.path == first.path
    assert calls == []  # no second conversion (not a wall-clock bound: load varies)
    assert weights.stat().st_mtime_ns == written


def test_truncated_cache_entry_is_detected_and_rebuilt(tiny_gguf):
    path = resolve_model(str(tiny_gguf)).path
    weights = path / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    again = resolve_model(str(tiny_gguf)).path
    assert (again / "model.safetensors").read_bytes() == good


def test_cache_entry_without_manifest_is_rebuilt(tiny_gguf):
    path = resolve_model(str(tiny_gguf)).path
    (path / "llmctl-manifest.json").unlink()
    (path / "config.json").unlink()
    again = resolve_model(str(tiny_gguf)).path
    assert (again / "config.json").is_file()


def test_missing_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no model at"):
        resolve_model(str(tmp_path / "nope"))


def test_directory_that_is_not_a_model(tmp_path):
    with pytest.raises(NotAModelError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_config_without_weights(tiny_llama, tmp_path):
    shutil.copy(tiny_llama / "config.json", tmp_path / "config.json")
    with pytest.raises(NotAModelError, match="no weights"):
        resolve_model(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UnsupportedArchitectureError, match="'bert'"):
        resolve_model(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(NotAModelError, match="not a .gguf"):
        resolve_model(str(path))


def test_unreadable_gguf(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(GGUFError, match="cannot read"):
        resolve_model(str(path))


def _count_network_use(monkeypatch) -> list:
    """Every name lookup or connection fails at once, as on a machine without a network,
    and is recorded."""
    import socket

    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise socket.gaierror(socket.EAI_NONAME, "no network in this test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


@pytest.mark.parametrize("offline_flag", [True, False])
def test_hub_id_unreachable_fails_with_advice(monkeypatch, tmp_path, offline_flag):
    """An uncached hub id without a network: OfflineError with the remedy. With
    HF_HUB_OFFLINE the network is not even tried (counted, not timed: a wall-clock bound
    flaps under load)."""
    from huggingface_hub import constants

    # huggingface_hub reads HF_HOME and HF_HUB_OFFLINE once, at import: set its constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline_flag)
    attempts = _count_network_use(monkeypatch)
    with pytest.raises(OfflineError, match="not reachable") as err:
        resolve_model("someorg/somemodel")
    assert "local directory" in err.value.remedy
    assert (attempts == []) == offline_flag


def test_info_of_tiny_model(tiny_llama):
    info = model_info(tiny_llama)
    assert (info.layers, info.hidden_size, info.heads, info.kv_heads) == (2, 64, 4, 2)
    # embed + lm_head (untied) + 2 x (attn 4096+2048+2048+4096 + mlp 3x8192 + 2 norms) + norm
    assert info.parameters == 2 * 512 * 64 + 2 * (12288 + 24576 + 128) + 64
    assert info.chat_template and info.eos_token == "<|im_end|>"
