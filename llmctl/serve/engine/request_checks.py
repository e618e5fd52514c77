"""What makes a request acceptable to an engine, checked in one place.

The engine (:meth:`llmctl.serve.engine.llm_engine.LLMEngine.add_request`) and the API
process in front of engine processes (:mod:`llmctl.serve.proc.engine`) run
:func:`check_request` on every request; the OpenAI frontend
(:mod:`llmctl.serve.openai`) runs the same checks one by one, earlier (before a tenant
is charged or a grammar compiled), and answers 400 with the error's ``param``: the
request field at fault, as OpenAI's error bodies name it. So a bad request is refused
with the same words wherever it comes from.
"""

from __future__ import annotations

from llmctl.errors import ResourceError, UsageError
from llmctl.serve.core.sampling_params import SamplingParams


class InvalidRequestError(UsageError):
    """A request field no engine can take; ``param`` names the field."""

    def __init__(self, message: str, remedy: str | None = None, param: str | None = None):
        super().__init__(message, remedy)
        self.param = param


class ContextLengthError(ResourceError):
    """The prompt, or the prompt with ``max_tokens``, does not fit the context."""

    def __init__(self, message: str, remedy: str | None = None, param: str | None = None):
        super().__init__(message, remedy)
        self.param = param


def check_prompt_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    """A prompt of at least one token, every one of them in the vocabulary."""
    if not ids:
        raise InvalidRequestError("the prompt is empty",
                                  "an empty prompt has nothing to continue: send at least "
                                  "one token", param)
    check_token_ids(ids, vocab_size, param)


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary "
                                  f"(0..{vocab_size - 1})",
                                  "encode the prompt with this model's tokenizer", param)


def check_logit_bias(token_ids, vocab_size: int) -> None:
    if token_ids and (top := max(token_ids)) >= vocab_size:
        raise InvalidRequestError(f"logit_bias: token id {top} is outside the vocabulary "
                                  f"(0..{vocab_size - 1})",
                                  "bias token ids of this model's tokenizer", "logit_bias")


def fit_context(prompt_len: int, max_tokens: int | None, max_model_len: int,
                cap: int | None = None, prompt_param: str = "prompt") -> int:
    """``max_tokens``, or when unset the room the context leaves (at most ``cap``);
    raises :class:`ContextLengthError` when the prompt or the two together do not fit."""
    room = max_model_len - prompt_len
    if room < 1:
        raise ContextLengthError(f"the prompt has {prompt_len} tokens; this model's context "
                                 f"is {max_model_len}", "shorten the prompt", prompt_param)
    if max_tokens is None:
        return room if cap is None else min(cap, room)
    if max_tokens > room:
        raise ContextLengthError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"context length {max_model_len}; lower max_tokens or shorten the prompt",
            None, "max_tokens")
    return max_tokens


def check_embedding_fits(prompt_len: int, max_model_len: int, param: str = "input") -> None:
    """An embedding's prompt may fill the context (nothing is generated after it)."""
    if prompt_len > max_model_len:
        raise ContextLengthError(f"the input has {prompt_len} tokens; this model's context "
                                 f"is {max_model_len}", "shorten the input", param)


def check_request(request_id: str, ids: list[int], params: SamplingParams, *,
                  vocab_size: int, max_model_len: int, prompt_logprobs: bool,
                  pooling: bool = False) -> SamplingParams:
    """``params`` with ``max_tokens`` filled in (the room left in the context), or raise
    :class:`InvalidRequestError` / :class:`ContextLengthError` naming what to change.
    ``prompt_logprobs`` / ``pooling``: whether the runner can return prompt log-probs /
    embeddings (:mod:`llmctl.serve.core.pooling`)."""
    check_prompt_ids(ids, vocab_size)
    check_logit_bias(params.logit_bias, vocab_size)
    if params.prompt_logprobs is not None and not prompt_logprobs:
        raise InvalidRequestError("this engine's runner cannot return prompt log-probs",
                                  "serve the checkpoint instead of the engine directory, or "
                                  "do not ask for prompt logprobs (echo with logprobs)")
    if params.pooling is not None:
        if not pooling:
            raise InvalidRequestError("this engine's runner cannot return embeddings",
                                      "serve the checkpoint instead of the engine directory",
                                      "input")
        if params.n != 1:
            raise InvalidRequestError("an embedding request has one sequence", "send n=1",
                                      "n")
        check_embedding_fits(len(ids), max_model_len)
        return params  # max_tokens is not read: nothing is sampled
    max_tokens = fit_context(len(ids), params.max_tokens, max_model_len)
    if max_tokens == params.max_tokens:
        return params
    return params.model_copy(update={"max_tokens": max_tokens})
