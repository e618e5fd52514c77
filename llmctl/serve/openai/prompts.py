"""Prompts to token ids: completions' texts and token lists, chat conversations through
the model's chat template, and the bound that refuses a text too long for the context
before it is tokenized (a 400 in microseconds instead of seconds of tokenizing a
multi-megabyte prompt; :mod:`llmctl.serve.api.limits` has the other request limits)."""

from __future__ import annotations

import functools
from typing import Any

from llmctl.serve.engine.request_checks import InvalidRequestError, check_prompt_ids
from llmctl.serve.openai import errors
from llmctl.serve.openai.content_tokens import ContentTokens
from llmctl.serve.openai.models import ServedModel
from llmctl.serve.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeChatRequest,
)
from llmctl.serve.openai.tools.request import template_tools, warn_if_template_ignores_tools


def max_token_chars(tokenizer) -> int:
    """The most characters one token stands for: the longest entry of the vocabulary,
    added and special tokens included. For byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM)
    an entry's length is its byte count, at least the characters it decodes to; for
    SentencePiece it is its characters ("▁" for a space), a byte-fallback entry
    ("<0xE3>") overstating its one byte. An overstatement only loosens the bound."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        return 0
    return max((len(token) for token in vocab), default=0)


def max_prompt_chars(tokenizer, max_model_len: int) -> int | None:
    """Characters above which a text cannot fit ``max_model_len`` tokens; None: no bound
    is known (an empty or unreadable vocabulary).

    The direction matters: every token decodes to at most ``L = max_token_chars``
    characters, so a text of ``c`` characters has at least ``c / L`` tokens, and
    ``c > max_model_len * L`` means more tokens than the context holds -- refusing it is
    always right. (The converse -- "a token is at least one character" -- is false:
    byte-level tokenizers spend up to four tokens on one character, so no bound on
    characters can say a text *fits*.) This assumes the tokenizer's normalizer keeps
    every character, as byte-level BPE and SentencePiece BPE do; one that deletes
    characters (whitespace collapsing, control-character stripping) could fit a longer
    text, which is then refused: a prompt that long only fits by being thrown away."""
    per_token = max_token_chars(tokenizer)
    return max_model_len * per_token if per_token > 0 else None


def chat_chars(req) -> int:
    """The characters a conversation's messages bring to its rendered template."""
    return sum(len(m.text()) + len(m.name or "") for m in req.messages)


def request_chars(req) -> int:
    """How much text a parsed request asks to tokenize (prompts or messages)."""
    if hasattr(req, "messages"):
        return chat_chars(req)
    if hasattr(req, "inputs"):  # embeddings
        return sum(len(x) for x in req.inputs())
    prompts = req.prompts() if hasattr(req, "prompts") else [getattr(req, "prompt", "")]
    return sum(len(p) for p in prompts)


# apply_chat_template's own arguments and those the server fills from the request
_SERVER_TEMPLATE_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "chat_template"})


class Prompts:
    """Requests' prompts as token ids, checked (:mod:`llmctl.serve.engine.request_checks`)
    before anything is submitted."""

    def __init__(self, tokenizer, model: ServedModel,
                 allow_special_tokens_in_content: bool = False,
                 default_template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.model = model
        # --default-chat-template-kwargs: under every request's chat_template_kwargs
        self.default_template_kwargs = dict(default_template_kwargs or {})
        # chat: special tokens' text inside messages becomes those tokens (the template's
        # ones always do); off by default: message text stays text (content_tokens.py)
        self.allow_special_tokens_in_content = allow_special_tokens_in_content

    @functools.cached_property
    def max_prompt_chars(self) -> int | None:
        return max_prompt_chars(self.tokenizer, self.model.max_model_len)

    @functools.cached_property
    def content_tokens(self) -> ContentTokens:
        return ContentTokens(self.tokenizer)

    def check_chars(self, chars: int, param: str) -> None:
        """Refuse a text that cannot fit the context before tokenizing it."""
        bound = self.max_prompt_chars
        if bound is not None and chars > bound:
            raise errors.bad_request(
                f"the {param} has {chars} characters, more than this model's context of "
                f"{self.model.max_model_len} tokens can hold (at most {bound}); shorten it",
                param)

    def completion(self, req: CompletionRequest) -> list[list[int]]:
        """Each prompt of a completions request as token ids."""
        for prompt in req.prompts():  # all of them before any is tokenized
            if isinstance(prompt, str):
                self.check_chars(len(prompt), "prompt")
        prompts = []
        for prompt in req.prompts():
            ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
            try:
                check_prompt_ids(ids, self.model.vocab_size, "prompt")
            except InvalidRequestError as exc:
                raise errors.bad_request(exc.message, exc.param) from None
            prompts.append(ids)
        return prompts

    def tokenize(self, text: str, add_special_tokens: bool = True,
                 param: str = "prompt") -> list[int]:
        try:
            return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        except (TypeError, ValueError) as exc:  # e.g. a lone surrogate ("\ud800") in JSON
            raise errors.bad_request(f"the {param} cannot be tokenized ({exc}); send valid "
                                     "Unicode text", param) from None

    def echo_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def template_kwargs(self, req) -> dict[str, Any]:
        """The server's default template variables with the request's over them; the
        ones the server sets itself (messages, tools, ...) are a 400, not a clash."""
        given = getattr(req, "chat_template_kwargs", None) or {}
        if taken := sorted(_SERVER_TEMPLATE_ARGS & set(given)):
            raise errors.bad_request(
                f"chat_template_kwargs cannot set {', '.join(taken)}: the server passes "
                "them from the request's own fields", "chat_template_kwargs")
        return {**self.default_template_kwargs, **given}

    def chat(self, req: ChatCompletionRequest | TokenizeChatRequest) -> list[int]:
        """The prompt ids of a conversation: its chat template's text, tokenized without
        special tokens (the template writes them) unless the request asks for more."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise errors.bad_request("this model has no chat template; use /v1/completions")
        self.check_chars(chat_chars(req), "messages")
        messages = [m.for_template() for m in req.messages]
        extra: dict[str, Any] = {"continue_final_message": True} if getattr(
            req, "continue_final_message", False) else {}
        if tools := template_tools(req):
            extra["tools"] = tools
            warn_if_template_ignores_tools(self.tokenizer)
        extra.update(self.template_kwargs(req))

        def render(messages: list[dict]) -> str:
            try:
                return self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=req.add_generation_prompt,
                    tokenize=False, **extra)
            except Exception as exc:  # jinja raises on templates that reject the roles
                raise errors.bad_request(
                    f"the chat template rejected the messages: {exc}") from None

        text = render(messages)
        add_special = getattr(req, "add_special_tokens", False)
        if self.allow_special_tokens_in_content:
            return self.tokenize(text, add_special)
        try:
            return self.content_tokens.encode(text, messages, render, add_special)
        except (TypeError, ValueError) as exc:  # as in tokenize
            raise errors.bad_request(f"the prompt cannot be tokenized ({exc}); send valid "
                                     "Unicode text", "messages") from None
