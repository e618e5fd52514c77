"""``/v1/completions``: a request's prompts as engine requests."""

from __future__ import annotations

import uuid
from typing import Any

from llmctl.serve.openai.jobs import Job
from llmctl.serve.openai.models import OpenAIModels
from llmctl.serve.openai.prompts import Prompts
from llmctl.serve.openai.protocol import CompletionRequest
from llmctl.serve.openai.sampling import Sampling


class OpenAICompletions:
    kind = "completion"  # the response shape (llmctl.serve.openai.responses)

    def __init__(self, prompts: Prompts, sampling: Sampling, models: OpenAIModels) -> None:
        self.prompts = prompts
        self.sampling = sampling
        self.models = models

    def encode(self, req: CompletionRequest) -> list[list[int]]:
        return self.prompts.completion(req)

    def jobs(self, req: CompletionRequest, prompts: list[list[int]],
             cap: int | None = None) -> tuple[list[Job], Any]:
        """One engine request per prompt and their shared sampling parameters."""
        rid = f"cmpl-{uuid.uuid4().hex}"
        # One parameter set for all prompts: checked against the longest, which also
        # bounds an unset max_tokens for every prompt. Echo without generation still
        # samples one token (the engine needs a step to end on; vLLM does the same).
        longest = max(len(ids) for ids in prompts)
        max_tokens = 1 if req.prompt_only else req.max_tokens
        params = self.sampling.params(req, longest, max_tokens, req.logprobs,
                                      req.logprobs if req.echo else None, cap)
        jobs = [Job(f"{rid}-{i}", ids, i * req.n,
                    echo=self.prompts.echo_text(text) if req.echo else None,
                    lora=self.models.adapter_of(req.model))
                for i, (text, ids) in enumerate(zip(req.prompts(), prompts))]
        return jobs, params
