"""Model sources: what can stand behind ``llmctl serve MODEL``, as a registry.

The engine core is the lower layer: it owns this interface, and packages above it
register into it. ``llmctl.engines`` registers engine directories from ``llmctl
build-engine`` when it is imported (its ``__init__``; the CLI imports it to check MODEL),
so nothing here imports it. A MODEL no registered source claims is a checkpoint, a
``.gguf`` file, a hub id or an embedded alias: the paged torch engine.

A source's ``claims`` must be cheap (a stat, a manifest read: no torch, no weights);
``open`` builds the engine. Sources are asked in registration order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from llmctl.serve.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class OpenedModel:
    engine: LLMEngine
    name: str  # what /v1/models lists when no --served-model-name is given
    aliases: tuple[str, ...] = ()  # other names clients may send as `model`


class ModelSource(Protocol):
    name: str

    def claims(self, model: str) -> bool: ...

    def open(self, model: str, engine_kwargs: dict[str, Any]) -> OpenedModel: ...


class CheckpointSource:
    """Anything :func:`llmctl.models.resolve.resolve_model` takes, on the paged engine."""

    name = "checkpoint"

    def claims(self, model: str) -> bool:
        return True

    def open(self, model: str, engine_kwargs: dict[str, Any]) -> OpenedModel:
        from llmctl.serve.engine.llm_engine import LLMEngine

        return OpenedModel(LLMEngine.from_args(model, **engine_kwargs), model)


_SOURCES: dict[str, ModelSource] = {}
_FALLBACK = CheckpointSource()


def register_model_source(source: ModelSource) -> None:
    """Add ``source`` (or replace the one of the same name: imports may repeat)."""
    _SOURCES[source.name] = source


def model_sources() -> tuple[ModelSource, ...]:
    """The registered sources in the order they are asked, then the checkpoint fallback."""
    return (*_SOURCES.values(), _FALLBACK)


def source_for(model: str) -> ModelSource:
    return next(source for source in model_sources() if source.claims(model))


def open_model(model: str, engine_kwargs: dict[str, Any]) -> OpenedModel:
    return source_for(model).open(model, engine_kwargs)
