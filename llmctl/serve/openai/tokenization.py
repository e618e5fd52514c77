"""``/tokenize`` and ``/detokenize`` (vLLM's routes and bodies)."""

from __future__ import annotations

from llmctl.serve.engine.request_checks import InvalidRequestError, check_token_ids
from llmctl.serve.openai import errors
from llmctl.serve.openai.prompts import Prompts
from llmctl.serve.openai.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)


class OpenAITokenization:
    def __init__(self, prompts: Prompts) -> None:
        self.prompts = prompts

    def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        prompts = self.prompts
        if isinstance(req, TokenizeChatRequest):
            ids = prompts.chat(req)
        else:
            prompts.check_chars(len(req.prompt), "prompt")
            ids = prompts.tokenize(req.prompt, req.add_special_tokens)
        return {"count": len(ids), "max_model_len": prompts.model.max_model_len,
                "tokens": ids,
                "token_strs": prompts.tokenizer.convert_ids_to_tokens(ids)
                if req.return_token_strs else None}

    def detokenize(self, req: DetokenizeRequest) -> dict:
        try:  # protocol.py has refused negative ids
            check_token_ids(req.tokens, self.prompts.model.vocab_size, "tokens")
        except InvalidRequestError as exc:
            raise errors.bad_request(exc.message, exc.param) from None
        return {"prompt": self.prompts.tokenizer.decode(req.tokens)}
