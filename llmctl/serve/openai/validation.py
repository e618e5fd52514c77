"""A request body as parsed JSON, then as a validated request, errors in OpenAI's shape."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError

from llmctl.serve.openai import errors
from llmctl.serve.openai.protocol import allowed_range

_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal",
                 "finite_number"}


def first_error(exc: ValidationError, model: type[BaseModel]) -> tuple[str, str | None]:
    """OpenAI's message and ``param`` for the first problem pydantic found."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"] if p != "body")
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"unrecognized request argument supplied: {loc}", loc
    if kind == "missing":
        return f"missing required parameter: {loc}", loc
    if kind in _RANGE_ERRORS and (bounds := allowed_range(model, loc)):
        what = "is not a finite number" if kind == "finite_number" else "is out of range"
        return f"{loc}: {err['input']!r} {what}; allowed: {bounds}", loc
    message = str(err["ctx"]["error"]) if kind == "value_error" else err["msg"]
    return (f"{loc}: {message}" if loc else message), loc or None


def validated(body: dict, model_cls):
    """``body`` as ``model_cls`` (or as the class it picks, given the body)."""
    if not isinstance(model_cls, type):
        model_cls = model_cls(body)
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        message, param = first_error(exc, model_cls)
        raise errors.bad_request(message, param) from None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> dict:
    """A request body's bytes as a JSON object (no NaN / Infinity), or a 400."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise errors.bad_request(f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise errors.bad_request("malformed JSON body: nested too deeply") from None
    return require_object(body)


def require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise errors.bad_request("the request body must be a JSON object")
    return body
