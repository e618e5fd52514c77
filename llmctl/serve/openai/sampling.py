"""An OpenAI request's sampling parameters: its fields, the context it leaves, its
structured-output grammar and what its tools ask of sampling."""

from __future__ import annotations

from typing import Any

from llmctl.errors import UsageError
from llmctl.serve.engine.request_checks import (
    ContextLengthError,
    InvalidRequestError,
    check_logit_bias,
    fit_context,
)
from llmctl.serve.openai import errors
from llmctl.serve.openai.errors import APIError
from llmctl.serve.openai.models import ServedModel
from llmctl.serve.openai.protocol import ChatCompletionRequest
from llmctl.serve.openai.structured import StructuredForm, structured_form
from llmctl.serve.openai.tools.request import ToolPlan, ToolRequestError, plan_tools
from llmctl.serve.sample.compile_pool import CompileBusyError, CompileTimeoutError


class Sampling:
    def __init__(self, model: ServedModel, grammar_factory=None,
                 auto_tool_parser: str | None = None) -> None:
        self.model = model
        self.grammars = grammar_factory  # llmctl.serve.sample.grammar; None: unavailable
        # tool_choice "auto": the tool_parsers.AUTO_PARSERS name (--enable-auto-tool-choice
        # --tool-call-parser NAME); None: "auto" is refused, as vLLM does
        self.auto_tool_parser = auto_tool_parser

    def params(self, req, prompt_len: int, max_tokens: int | None, logprobs: int | None,
               prompt_logprobs: int | None = None, cap: int | None = None,
               overrides: dict[str, Any] | None = None, reasoning=None):
        """``cap``: the tenant's max_tokens per request, bounding an unset max_tokens;
        ``overrides``: SamplingParams fields set by a feature (a ToolPlan's);
        ``reasoning``: the request's ReasoningPlan, whose thinking no grammar masks."""
        from llmctl.serve.core.sampling_params import SamplingParams

        prompt_param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        try:
            max_tokens = fit_context(prompt_len, max_tokens, self.model.max_model_len, cap,
                                     prompt_param)
        except ContextLengthError as exc:
            raise errors.bad_request(exc.message, exc.param) from None
        extra: dict[str, Any] = {}
        if prompt_logprobs is not None:
            extra["prompt_logprobs"] = prompt_logprobs
        if bias := req.logit_bias_ids:
            try:
                check_logit_bias(bias, self.model.vocab_size)
            except InvalidRequestError as exc:
                raise errors.bad_request(exc.message, exc.param) from None
            extra["logit_bias"] = bias
        extra.update(overrides or {})
        self._constrain(req, extra, reasoning)
        try:  # protocol.py has checked every field; this is the engine's own last word
            return SamplingParams(
                n=req.n, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                top_k=req.top_k, min_p=req.min_p, seed=req.seed, stop=req.stop_list,
                stop_token_ids=req.stop_token_ids or (), ignore_eos=req.ignore_eos,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty, logprobs=logprobs, **extra)
        except UsageError as exc:
            raise errors.bad_request(exc.message) from None

    def _constrain(self, req, extra: dict[str, Any], reasoning) -> None:
        """``extra["logits_constraint"]``: the request's structured-output grammar (or
        its tools'), held off while a reasoning model thinks."""
        form = structured_form(req)
        if form is not None:
            if extra.get("logits_constraint") is not None:  # tool_choice required/named
                raise errors.bad_request(
                    f'{form.param} cannot be combined with tool_choice "required" or a '
                    "named function: both set the output's shape", form.param)
            extra["logits_constraint"] = self.grammar(req, form)
        if reasoning is not None and extra.get("logits_constraint") is not None:
            try:
                extra["logits_constraint"] = reasoning.gate(extra["logits_constraint"])
            except ValueError as exc:
                raise errors.bad_request(str(exc), form.param if form else "tools") from None

    def tool_plan(self, req: ChatCompletionRequest) -> ToolPlan:
        try:
            return plan_tools(req, self.grammars, self.auto_tool_parser)
        except ToolRequestError as exc:
            raise errors.bad_request(str(exc), exc.param) from None
        except CompileBusyError as exc:
            raise errors.unavailable(str(exc), retry_after=1) from None

    def grammar(self, req, form: StructuredForm | None = None):
        """The request's compiled grammar (a ConstraintFactory), None if it asks for
        none: llguidance's refusal a 400 with its message, a compile past the time limit
        a 400 too (the grammar is what is too complex), a busy compile pool a 503."""
        form = form if form is not None else structured_form(req)
        if form is None:
            return None
        if self.grammars is None:
            raise errors.bad_request(f"{form.param} is not available on this server "
                                     "(llguidance is not installed)", form.param)
        try:
            return self.grammars.compiled(form.kind, form.source)
        except CompileTimeoutError as exc:
            raise APIError(400, f"{form.param}: {exc}", param=form.param,
                           code="grammar_too_complex") from None
        except ValueError as exc:
            raise errors.bad_request(f"{form.param}: {exc}", form.param) from None
        except CompileBusyError as exc:
            raise errors.unavailable(str(exc), retry_after=1) from None
