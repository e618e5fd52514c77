"""The model-source registry ``llmctl serve MODEL`` opens models through."""

from __future__ import annotations

import pytest

from llmctl.serve.engine import sources
from llmctl.serve.engine.sources import (
    OpenedModel,
    model_sources,
    open_model,
    register_model_source,
)


class _Source:
    def __init__(self, name: str, prefix: str) -> None:
        self.name, self.prefix = name, prefix
        self.opened: list[tuple[str, dict]] = []

    def claims(self, model: str) -> bool:
        return model.startswith(self.prefix)

    def open(self, model: str, engine_kwargs: dict) -> OpenedModel:
        self.opened.append((model, engine_kwargs))
        return OpenedModel(engine=f"engine:{model}", name=model.upper(), aliases=(model,))


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(sources, "_SOURCES", {})


def test_the_first_source_that_claims_the_model_opens_it(registry):
    a, b = _Source("a", "x"), _Source("b", "xy")
    register_model_source(a)
    register_model_source(b)
    opened = open_model("xyz", {"max_num_seqs": 2})
    assert opened == OpenedModel("engine:xyz", "XYZ", ("xyz",))
    assert a.opened == [("xyz", {"max_num_seqs": 2})] and b.opened == []


def test_registering_a_name_again_replaces_it_in_place(registry):
    first, other, again = _Source("a", "x"), _Source("b", "y"), _Source("a", "z")
    for source in (first, other, again):
        register_model_source(source)
    names = [s.name for s in model_sources()]
    assert names == ["a", "b", "checkpoint"]
    assert model_sources()[0] is again


def test_a_model_no_source_claims_is_a_checkpoint_on_the_paged_engine(registry, monkeypatch):
    from llmctl.serve.engine import llm_engine

    seen = []
    monkeypatch.setattr(llm_engine.LLMEngine, "from_args",
                        classmethod(lambda cls, model, **kw: seen.append((model, kw)) or "paged"))
    register_model_source(_Source("a", "x"))
    opened = open_model("smollm2-135m", {"dtype": "bfloat16"})
    assert opened == OpenedModel("paged", "smollm2-135m", ())
    assert seen == [("smollm2-135m", {"dtype": "bfloat16"})]
