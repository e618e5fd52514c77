"""Request checks in one place (llmctl.serve.engine.request_checks): the engine and the
OpenAI frontend raise the same errors, naming the request field at fault."""

from __future__ import annotations

import pytest

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.request_checks import (
    ContextLengthError,
    InvalidRequestError,
    check_logit_bias,
    check_prompt_ids,
    check_request,
    fit_context,
)


@pytest.mark.parametrize("call, param, words", [
    (lambda: check_prompt_ids([], 10), "prompt", "the prompt is empty"),
    (lambda: check_prompt_ids([3, 10], 10), "prompt", "token id 10 is outside the vocabulary"),
    (lambda: check_logit_bias({12: 1.0}, 10), "logit_bias", "token id 12 is outside"),
    (lambda: fit_context(64, None, 64, prompt_param="messages"), "messages",
     "the prompt has 64 tokens; this model's context is 64"),
    (lambda: fit_context(60, 10, 64), "max_tokens", "exceeds the context length 64"),
])
def test_each_check_names_the_field(call, param, words):
    with pytest.raises((InvalidRequestError, ContextLengthError)) as info:
        call()
    assert info.value.param == param and words in info.value.message


def test_fit_context_fills_an_unset_max_tokens_up_to_the_cap():
    assert fit_context(60, None, 64) == 4
    assert fit_context(10, None, 64, cap=5) == 5
    assert fit_context(10, 7, 64, cap=5) == 7  # a cap bounds only what is unset


def test_check_request_fills_max_tokens_and_keeps_a_set_one():
    params = check_request("r", [1, 2], SamplingParams(max_tokens=None), vocab_size=10,
                           max_model_len=8, prompt_logprobs=True)
    assert params.max_tokens == 6
    given = SamplingParams(max_tokens=3)
    assert check_request("r", [1, 2], given, vocab_size=10, max_model_len=8,
                         prompt_logprobs=True) is given
