"""Errors in Anthropic's shape on the Messages routes: ``{"type": "error", "error":
{"type": ..., "message": ...}}``, the error type named by the status as Anthropic names
them (the statuses stay the server's: 503 where Anthropic would say 529, 408 for the
request timeout)."""

from __future__ import annotations

from typing import Any

from llmctl.serve.openai.errors import APIError

# the routes whose errors take Anthropic's shape (the path and everything under it)
MESSAGES_PATH = "/v1/messages"

_TYPES = {400: "invalid_request_error", 401: "authentication_error",
          403: "permission_error", 404: "not_found_error", 408: "timeout_error",
          413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
          503: "overloaded_error", 504: "timeout_error"}


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_body(exc: APIError) -> dict[str, Any]:
    message = exc.message
    if exc.param and exc.param not in message:  # Anthropic's shape has no param field
        message = f"{exc.param}: {message}"
    return {"type": "error", "error": {"type": error_type(exc.status), "message": message}}


def error_body(exc: APIError, path: str) -> dict[str, Any]:
    """``exc``'s body as the route at ``path`` answers errors: Anthropic's shape on the
    Messages routes, OpenAI's everywhere else."""
    return anthropic_body(exc) if is_messages_path(path) else exc.body()
