"""One engine request of an OpenAI request: a prompt and the choices it feeds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmctl.serve.openai.reasoning.parsers import ReasoningPlan
from llmctl.serve.openai.tools.request import ToolPlan


@dataclass
class Job:
    """One engine request: a prompt and the choices it feeds."""

    request_id: str
    prompt_ids: list[int]
    choice_offset: int
    stream: Any = None  # the server's output stream (AsyncEngine.submit); batch: None
    echo: str | None = None  # the prompt text, put before each choice's text (echo=true)
    trace: Any = None  # the request's RequestTrace (llmctl.serve.api.tracing) when tracing
    tools: ToolPlan = field(default_factory=ToolPlan)  # chat: how its choices are read
    lora: str | None = None  # the LoRA adapter it runs with (its ``model``); None: base
    # chat with --reasoning-parser: how its choices split into thinking and answer
    reasoning: ReasoningPlan | None = None


def response_id(jobs: list[Job]) -> str:
    """The response's id: its engine requests' ids without the prompt index."""
    return jobs[0].request_id.rsplit("-", 1)[0]
