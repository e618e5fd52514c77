"""``/v1/chat/completions``: a conversation as an engine request."""

from __future__ import annotations

import uuid
from typing import Any

from llmctl.serve.openai.jobs import Job
from llmctl.serve.openai.models import OpenAIModels
from llmctl.serve.openai.prompts import Prompts
from llmctl.serve.openai.protocol import ChatCompletionRequest
from llmctl.serve.openai.reasoning.parsers import ReasoningParser
from llmctl.serve.openai.sampling import Sampling
from llmctl.serve.openai.tools.request import ToolPlan


class OpenAIChat:
    kind = "chat"  # the response shape (llmctl.serve.openai.responses)

    def __init__(self, prompts: Prompts, sampling: Sampling, models: OpenAIModels,
                 reasoning: ReasoningParser | None = None) -> None:
        self.prompts = prompts
        self.sampling = sampling
        self.models = models
        self.reasoning = reasoning  # --reasoning-parser; None: the output is all content

    def encode(self, req: ChatCompletionRequest) -> list[int]:
        return self.prompts.chat(req)

    def tool_plan(self, req: ChatCompletionRequest) -> ToolPlan:
        return self.sampling.tool_plan(req)

    def jobs(self, req: ChatCompletionRequest, ids: list[int], cap: int | None = None,
             tools: ToolPlan | None = None) -> tuple[list[Job], Any]:
        """``tools``: the request's plan when already made (:meth:`tool_plan`)."""
        tools = tools if tools is not None else self.tool_plan(req)
        reasoning = self.reasoning.plan(ids) if self.reasoning is not None else None
        params = self.sampling.params(req, len(ids), req.token_limit, req.num_logprobs,
                                      cap=cap, overrides=tools.sampling_overrides(),
                                      reasoning=reasoning)
        return [Job(f"chatcmpl-{uuid.uuid4().hex}-0", ids, 0, tools=tools,
                    lora=self.models.adapter_of(req.model), reasoning=reasoning)], params
