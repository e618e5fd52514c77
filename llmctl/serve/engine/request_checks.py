"""What makes a request acceptable to an engine, checked wherever it is submitted.

One function for the engine (:meth:`llmctl.serve.engine.llm_engine.LLMEngine.add_request`) and
for the API process in front of engine processes (:mod:`llmctl.serve.proc.engine`), so
a bad request is refused at once, in the caller, with the same words either way.
"""

from __future__ import annotations

from llmctl.errors import ResourceError, UsageError
from llmctl.serve.core.sampling_params import SamplingParams


def check_request(request_id: str, ids: list[int], params: SamplingParams, *,
                  vocab_size: int, max_model_len: int, prompt_logprobs: bool
                  ) -> SamplingParams:
    """``params`` with ``max_tokens`` filled in (the room left in the context), or raise
    :class:`UsageError` / :class:`ResourceError` naming what to change."""
    if not ids:
        raise UsageError(f"request {request_id!r} has an empty prompt",
                         "send at least one token")
    if any(t < 0 or t >= vocab_size for t in ids):
        raise UsageError(f"request {request_id!r} has token ids outside [0, {vocab_size})",
                         "encode the prompt with this model's tokenizer")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise UsageError(f"logit_bias names token {max(params.logit_bias)}, outside the "
                         f"vocabulary [0, {vocab_size})",
                         "bias token ids of this model's tokenizer")
    if params.prompt_logprobs is not None and not prompt_logprobs:
        raise UsageError("this engine's runner cannot return prompt log-probs",
                         "serve the checkpoint instead of the engine directory, or do "
                         "not ask for prompt logprobs (echo with logprobs)")
    room = max_model_len - len(ids)
    if params.max_tokens is None:
        if room < 1:
            raise ResourceError(
                f"the prompt has {len(ids)} tokens; the context length is {max_model_len}",
                "shorten the prompt")
        return params.model_copy(update={"max_tokens": room})
    if params.max_tokens > room:
        raise ResourceError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"context length ({max_model_len})", "lower max_tokens or shorten the prompt")
    return params
