"""The OpenAI serving pieces, composed once for a model: what the HTTP server
(:mod:`llmctl.serve.api.handler`) and ``llmctl batch`` (:mod:`llmctl.serve.batch.runner`)
both hold, so a batch line gets what the HTTP API would answer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmctl.serve.openai.chat import OpenAIChat
from llmctl.serve.openai.completions import OpenAICompletions
from llmctl.serve.openai.embeddings import EmbeddingAssembly, OpenAIEmbeddings
from llmctl.serve.openai.models import OpenAIModels, ServedModel
from llmctl.serve.openai.prompts import Prompts
from llmctl.serve.openai.reasoning.parsers import reasoning_parser as reasoning_parser_for
from llmctl.serve.openai.responses import Assembly, Responses
from llmctl.serve.openai.responses_api.serving import OpenAIResponsesAPI
from llmctl.serve.openai.sampling import Sampling
from llmctl.serve.openai.tokenization import OpenAITokenization
from llmctl.serve.openai.validation import validated


class Frontend:
    """OpenAI bodies in, engine requests out, engine outputs back to OpenAI bodies, with
    neither HTTP nor an engine in it."""

    def __init__(self, tokenizer, model: ServedModel, grammar_factory=None,
                 lora_names: Callable[[], tuple[str, ...]] = tuple, *,
                 auto_tool_parser: str | None = None,
                 allow_special_tokens_in_content: bool = False,
                 reasoning_parser: str | None = None,
                 default_chat_template_kwargs: dict[str, Any] | None = None,
                 pooling: str = "last", embed_normalize: bool = True,
                 responses_store_size: int = 256) -> None:
        """``reasoning_parser``: a REASONING_PARSERS name (--reasoning-parser);
        ``default_chat_template_kwargs``: template variables under each request's;
        ``pooling`` / ``embed_normalize``: /v1/embeddings' (--pooling,
        --no-embed-normalize); ``responses_store_size``: how many responses
        /v1/responses keeps for previous_response_id (--responses-store-size)."""
        self.tokenizer = tokenizer
        self.model = model
        self.models = OpenAIModels(model, lora_names)  # lora_names: the engine's (they change)
        self.prompts = Prompts(tokenizer, model, allow_special_tokens_in_content,
                               default_chat_template_kwargs)
        self.sampling = Sampling(model, grammar_factory, auto_tool_parser)
        self.completions = OpenAICompletions(self.prompts, self.sampling, self.models)
        self.chat = OpenAIChat(self.prompts, self.sampling, self.models,
                               reasoning_parser_for(reasoning_parser, tokenizer))
        self.tokenization = OpenAITokenization(self.prompts)
        self.responses = Responses(tokenizer, self.models)
        self.responses_api = OpenAIResponsesAPI(self.chat, self.models, responses_store_size)
        self.embeddings = OpenAIEmbeddings(self.prompts, self.models, pooling, embed_normalize)

    def validate(self, body: dict, model_cls):
        """``body`` validated as ``model_cls`` (or as the class it picks, given the body),
        its ``model`` one this frontend serves."""
        parsed = validated(body, model_cls)
        self.models.check(parsed.model)
        return parsed

    def assembly(self, kind: str, req, jobs) -> Assembly | EmbeddingAssembly:
        """Where a response's outputs are collected (:class:`Assembly`; embeddings':
        :class:`EmbeddingAssembly`)."""
        if kind == OpenAIEmbeddings.kind:
            return self.embeddings.assembly(req, jobs)
        return Assembly(self.responses, kind, req, jobs)
