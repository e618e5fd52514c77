"""A request's body, read whole and parsed as a JSON object (or a 400)."""

from __future__ import annotations

from fastapi import Request

from llmctl.serve.openai.validation import parse_json


async def read_body(request: Request) -> dict:
    return parse_json(await request.body())
