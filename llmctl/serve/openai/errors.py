"""Errors in OpenAI's JSON shape, with the status code each condition deserves."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """Raised anywhere in a request; rendered as ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


def unauthorized() -> APIError:
    return APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    "authentication_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def model_forbidden(name: str) -> APIError:
    return APIError(403, f"this API key may not use the model {name!r}; use a key issued "
                    "for it", "permission_error", "model", "model_not_allowed")


def rate_limited(message: str, unit: str, headers: dict[str, str]) -> APIError:
    """A tenant over one of its limits: OpenAI's shape (type ``requests`` or ``tokens``,
    code ``rate_limit_exceeded``, as openai/codex#88 shows its API answering)."""
    return APIError(429, message, unit, code="rate_limit_exceeded", headers=headers)


def model_not_found(name: str, served: str) -> APIError:
    return APIError(404, f"the model {name!r} does not exist; this server serves {served!r}",
                    "invalid_request_error", "model", "model_not_found")


def overloaded(retry_after: int) -> APIError:
    return APIError(429, "the server is at its queue limit; retry later", "rate_limit_error",
                    code="queue_full", headers={"Retry-After": str(retry_after)})


def deadline_unmeetable(reason: str, retry_after: int) -> APIError:
    """503, not 429: the server is overloaded (RFC 9110 15.6.4), whoever sends; 429 stays
    for a client over its own limits (RFC 6585 section 4) or the full queue."""
    return APIError(503, f"the request {reason}", "server_error", code="deadline_unmeetable",
                    headers={"Retry-After": str(retry_after)})


def timed_out(seconds: float) -> APIError:
    return APIError(408, f"the request did not finish within {seconds:g} s (--request-timeout)",
                    "timeout_error", code="request_timeout")


def unavailable(message: str, retry_after: int = 5) -> APIError:
    return APIError(503, message, "server_error", code="unavailable",
                    headers={"Retry-After": str(retry_after)})


def internal(message: str) -> APIError:
    return APIError(500, message, "server_error", code="internal_error")
