"""Engine outputs back to OpenAI bodies: each output's update to each choice, and the
whole response once every choice is complete. The server's streams send the updates as
they come; the server's whole responses and ``llmctl batch`` collect them in an
:class:`Assembly`, so both answer the same body."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

from llmctl.serve.openai.jobs import Job, response_id
from llmctl.serve.openai.models import OpenAIModels
from llmctl.serve.openai.reasoning.split import Split, ThinkingSplitter
from llmctl.serve.openai.render import (
    Choice,
    TokenIdNames,
    Update,
    chat_response,
    completion_response,
    echo_prefix,
    updates_from_output,
    usage_block,
    without_generation,
)


class Responses:
    def __init__(self, tokenizer, models: OpenAIModels) -> None:
        self.tokenizer = tokenizer
        self.models = models

    def token_names(self, req):
        """How log-probs name tokens: their text, or ``token_id:N`` when asked."""
        return TokenIdNames() if req.return_tokens_as_token_ids else self.tokenizer

    def choice_updates(self, req, job: Job, out, started: set[int],
                       splitters: dict[int, ThinkingSplitter] | None = None
                       ) -> Iterator[tuple[int, Update]]:
        """What one engine output adds to each of its choices, shaped, as (choice index,
        update); ``started`` holds the choices that already had an update, ``splitters``
        each choice's reasoning split (with a reasoning parser)."""
        for upd in updates_from_output(out):
            index = job.choice_offset + upd.index
            upd = _shape(req, job, out, upd, index not in started)
            started.add(index)
            if job.reasoning is not None and splitters is not None:
                splitter = splitters.setdefault(index, job.reasoning.new_choice())
                upd = split_reasoning(splitter, upd)
            yield index, upd

    def response(self, kind: str, req, jobs: list[Job], choices: dict[int, Choice]) -> dict:
        """The non-streaming response body once every choice is complete."""
        ordered = [choices[i] for i in sorted(choices)]
        if jobs[0].tools.active:  # chat with tools: calls out of each choice's text
            for c in ordered:
                reader = jobs[0].tools.new_choice()
                _, _, c.finish_reason = reader.update(c.text, c.finish_reason or "length")
                c.text, c.tool_calls = reader.content, reader.tool_calls
        prompt_tokens = sum(len(j.prompt_ids) for j in jobs)
        reasoning = None
        if jobs[0].reasoning is not None:  # reasoning: null, not absent, when none came
            for c in ordered:
                c.reasoning = c.reasoning or ""
            reasoning = sum(c.reasoning_tokens for c in ordered)
        usage = usage_block(prompt_tokens, sum(c.num_tokens for c in ordered), reasoning)
        created = int(time.time())
        names = self.token_names(req)
        rid = response_id(jobs)
        model = self.models.response_model(jobs)
        if kind == "chat":
            return chat_response(rid, created, model, ordered, usage, names)
        return completion_response(rid, created, model, ordered, usage, names)


def split_reasoning(splitter: ThinkingSplitter, upd: Update) -> Update:
    """``upd`` with its thinking moved from ``text`` to ``reasoning``; the choice's last
    update also releases what the splitter held back (a possible tag)."""
    part = splitter.feed(upd.text, upd.token_ids)
    if upd.finish_reason:
        rest = splitter.finish()
        part = Split(part.reasoning + rest.reasoning, part.content + rest.content,
                     part.reasoning_tokens + rest.reasoning_tokens)
    return dataclasses.replace(upd, text=part.content, reasoning=part.reasoning,
                               reasoning_tokens=part.reasoning_tokens)


def _shape(req, job: Job, out, upd: Update, first: bool) -> Update:
    """Echo: the prompt (and its log-probs) before a choice's first text; without
    generation (``max_tokens: 0``) the sampled token is dropped."""
    if getattr(req, "prompt_only", False):
        upd = without_generation(upd)
    if job.echo is not None and first:
        upd = echo_prefix(upd, job.echo,
                          out.prompt_logprobs if upd.logprobs is not None else None,
                          out.prompt_token_ids)
    return upd


class Assembly:
    """One response put together from its engine requests' outputs."""

    def __init__(self, responses: Responses, kind: str, req, jobs: list[Job]) -> None:
        self.responses = responses
        self.kind = kind  # the response shape: "chat" | "completion"
        self.req = req
        self.jobs = jobs
        self.choices: dict[int, Choice] = {}
        self.started: set[int] = set()
        self.splitters: dict[int, ThinkingSplitter] = {}  # with a reasoning parser

    def updates(self, job: Job, out) -> Iterator[tuple[int, Update]]:
        """What ``out`` (an output of ``job``) adds to each choice, in order."""
        return self.responses.choice_updates(self.req, job, out, self.started,
                                             self.splitters)

    def add(self, index: int, upd: Update) -> None:
        self.choices.setdefault(index, Choice(index)).add(upd)

    def collect(self, job: Job, out) -> None:
        for index, upd in self.updates(job, out):
            self.add(index, upd)

    def body(self) -> dict:
        return self.responses.response(self.kind, self.req, self.jobs, self.choices)
