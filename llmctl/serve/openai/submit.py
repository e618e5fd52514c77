"""Submitting an OpenAI request's engine requests: all of them or none, and the engine's
refusals as the HTTP answers they deserve. The server (through :class:`AsyncEngine`) and
``llmctl batch`` (straight to the engine) both submit here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmctl.errors import LlmctlError
from llmctl.serve.engine.async_engine import DeadlineError, EngineDeadError, QueueFullError
from llmctl.serve.lora.adapter import LoRANotFoundError
from llmctl.serve.openai import errors
from llmctl.serve.openai.errors import APIError
from llmctl.serve.openai.jobs import Job
from llmctl.serve.proc.engine import EngineUnavailableError


def submit_all(jobs: list[Job], submit: Callable[[Job], Any], abort: Callable[[str], None],
               model_name: str, on_refused: Callable[[], None] = lambda: None) -> None:
    """``job.stream = submit(job)`` for every job, in order. When one is refused, those
    already submitted are aborted, ``on_refused`` runs (a tenant's grant is refunded) and
    the refusal is raised as an :class:`APIError` (unknown exceptions as they are)."""
    submitted = []
    try:
        for job in jobs:
            job.stream = submit(job)
            submitted.append(job)
    except BaseException as exc:
        for job in submitted:
            abort(job.request_id)
        on_refused()
        error = refusal(exc, jobs[0].lora, model_name)
        if error is None:
            raise
        raise error from None


def refusal(exc: BaseException, lora: str | None, model_name: str) -> APIError | None:
    """The answer to an engine's refusal to take a request; None: not a refusal."""
    if isinstance(exc, QueueFullError):  # it fits an emptier queue: retry helps
        return errors.overloaded(retry_after=1)
    if isinstance(exc, DeadlineError):
        return errors.deadline_unmeetable(str(exc), exc.retry_after)
    if isinstance(exc, (EngineDeadError, EngineUnavailableError)):
        return errors.unavailable(str(exc), exc.retry_after)
    if isinstance(exc, LoRANotFoundError):  # unloaded since the body was checked
        return errors.model_not_found(lora, model_name)
    if isinstance(exc, LlmctlError):
        return errors.bad_request(exc.message, getattr(exc, "param", None))
    return None
