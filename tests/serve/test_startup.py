"""``llmctl serve`` settings -> engine configuration (llmctl.serve.startup)."""

import pytest

from llmctl.errors import UsageError
from llmctl.serve.startup import ServeSettings, check, engine_kwargs


def test_engine_directories_get_only_what_the_user_gave():
    quiet = engine_kwargs(ServeSettings(model="e"), engine_dir=True)
    assert "dtype" not in quiet and "enable_prefix_caching" not in quiet
    asked = engine_kwargs(ServeSettings(model="e", dtype="float32", prefix_caching=True,
                                        given=frozenset({"dtype", "prefix_caching"})),
                          engine_dir=True)
    assert asked["dtype"] == "float32" and asked["enable_prefix_caching"] is True


def test_checkpoints_get_a_concrete_dtype(monkeypatch):
    from llmctl.utils import device

    monkeypatch.setattr(device, "cuda_available", lambda: False)
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx2"}))
    assert engine_kwargs(ServeSettings(model="m"), engine_dir=False)["dtype"] == "float32"
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    kwargs = engine_kwargs(ServeSettings(model="m", speculative="ngram"), engine_dir=False)
    assert kwargs["dtype"] == "bfloat16" and kwargs["speculative"]["method"] == "ngram"


def test_unknown_engine_is_refused():
    with pytest.raises(UsageError, match="unknown engine 'tgi'"):
        check(ServeSettings(model="m", engine="tgi"))
