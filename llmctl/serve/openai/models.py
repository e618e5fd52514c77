"""The model a server or a batch serves, and the names a request's ``model`` may take."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from llmctl.serve.openai import errors
from llmctl.serve.openai.jobs import Job

log = logging.getLogger("llmctl.serve")


@dataclass
class ServedModel:
    """What the engine says about the model it runs, as the API shows it."""

    model_name: str
    max_model_len: int
    vocab_size: int  # token ids are checked against it (the embedding may be padded)
    # the final hidden states' size: what /v1/embeddings returns; None: not known
    hidden_size: int | None = None
    extra_model_names: tuple[str, ...] = ()  # aliases clients may send
    created: int = field(default_factory=lambda: int(time.time()))


class OpenAIModels:
    """The served model, its aliases and the loaded LoRA adapters (which change):
    the check of a request's ``model`` and ``/v1/models``' entries."""

    def __init__(self, model: ServedModel, lora_names: Callable[[], tuple[str, ...]] = tuple):
        self.model = model
        self.lora_names = lora_names

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.model.model_name, *self.model.extra_model_names)

    def check(self, name: str | None) -> None:
        """A 404 unless ``name`` (a request's ``model``; None: the default) is served."""
        if name is not None and name not in self.served_names \
                and name not in self.lora_names():
            raise errors.model_not_found(name, self.model.model_name)

    def adapter_of(self, name: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names; None for the base model."""
        return None if name is None or name in self.served_names else name

    def response_model(self, jobs: list[Job]) -> str:
        """``model`` in responses: the adapter's name when one ran (as vLLM answers)."""
        return jobs[0].lora or self.model.model_name

    def cards(self, names: Iterable[str], may_use: Callable[[str], bool]) -> list[dict]:
        """``/v1/models`` entries: ``names`` of the base model, then each loaded adapter
        ``may_use`` allows, with ``parent`` the base model's name (as vLLM lists them)."""
        model = self.model
        card = {"object": "model", "created": model.created, "owned_by": "llmctl",
                "max_model_len": model.max_model_len}
        return [{"id": name, **card, "parent": None} for name in names] + [
            {"id": name, **card, "parent": model.model_name}
            for name in self.lora_names() if may_use(name)]


def vocab_and_grammars(engine) -> tuple[int, Any]:
    """The vocabulary token ids are checked against, and the structured-output grammar
    factory (None when llguidance is missing: response_format is then refused)."""
    tokenizer = engine.tokenizer
    # The embedding may be padded beyond the tokenizer; token ids are checked against it.
    vocab_size = max(len(tokenizer), engine.spec.vocab_size)
    grammars = None
    try:
        from llmctl.serve.sample.grammar import GrammarFactory

        grammars = GrammarFactory(tokenizer, vocab_size)
    except Exception as exc:  # noqa: BLE001 - structured output is optional
        log.warning("response_format disabled: %s", exc)
    return vocab_size, grammars
