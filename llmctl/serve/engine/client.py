"""What :class:`~llmctl.serve.engine.async_engine.AsyncEngine` (and ``llmctl batch``)
drive: the engine in this process (:class:`~llmctl.serve.engine.llm_engine.LLMEngine`)
or the engine processes behind one front (:class:`~llmctl.serve.proc.engine.ProcessEngine`).

Both are driven from one thread that calls :meth:`EngineClient.step` in a loop;
``add_request``, ``abort_request`` and the LoRA calls are thread-safe (they validate in
the caller, :mod:`llmctl.serve.engine.request_checks`, and queue the change for the
next step). Optional, engine processes only, read with ``getattr``: ``close()`` (stop
the processes), ``healthy`` (False while no replica can take work) and
``retry_after`` (seconds until one may).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from llmctl.serve.engine.outputs import RequestOutput
from llmctl.serve.engine.stats import EngineStats


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: Any  # the model's Hugging Face tokenizer
    max_model_len: int  # the context length requests are checked against
    spec: Any  # the model's description; ``spec.vocab_size`` bounds token ids

    # --- requests ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: list[int], params, *, priority: int = 0,
                    arrival_time: float | None = None, **who) -> None:
        """Queue a request; raises at once (in the caller) when it is invalid."""

    def abort_request(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]:
        """One scheduling step; raises only on the engine's own fault."""

    def stats(self) -> EngineStats:
        """A snapshot of the engine's state (llmctl.serve.engine.stats)."""

    # --- admission: how requests are ordered and bounded --------------------------------
    def admission_key(self, priority: int, priority_class: str | None) -> tuple: ...

    def queue_key(self, priority_class: str | None) -> tuple: ...

    def wait_bound(self, priority_class: str | None) -> float | None: ...

    # --- LoRA adapters --------------------------------------------------------------------
    def lora_names(self) -> tuple[str, ...]: ...

    def add_lora(self, name: str, path: str) -> None: ...

    def remove_lora(self, name: str) -> None: ...

