"""Constrained decoding for ``response_format`` through llguidance.

llguidance compiles a JSON schema (or "any JSON object") to a grammar and, for each
step, gives the set of tokens that keep the output a valid prefix. We turn that set
into a logits mask; the engine calls :meth:`JsonConstraint.__call__` before sampling
and :meth:`accept` after. It runs on CPU (a Rust extension, no GPU code).
"""

from __future__ import annotations

import json
from typing import Any

from llmctl.errors import MissingDependencyError

_ANY_OBJECT = {"type": "object"}


class GrammarFactory:
    """Holds the tokenizer wrapper (built once per server) and compiles grammars."""

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        try:
            import llguidance
            import llguidance.hf
        except ImportError:
            raise MissingDependencyError(
                "response_format needs the llguidance package",
                "pip install 'llmctl[serve]' (llguidance)") from None
        self._llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def grammar_for(self, kind: str, schema: dict[str, Any] | None) -> str:
        """Compile now so an invalid schema is a 400 before anything is queued."""
        schema = schema if kind == "json_schema" else _ANY_OBJECT
        grammar = self._llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False})
        problem = self._llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem:  # an empty string means the grammar is usable
            raise ValueError(f"unsupported JSON schema: {problem}")
        return grammar

    def constraint(self, grammar: str) -> JsonConstraint:
        return JsonConstraint(self._llg.LLMatcher(self.tokenizer, grammar), self.vocab_size)


class JsonConstraint:
    """Per-sequence state: masks logits to tokens the grammar allows next."""

    def __init__(self, matcher, vocab_size: int) -> None:
        import llguidance.torch as llt

        self._llt = llt
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._bitmask = llt.allocate_token_bitmask(1, vocab_size)

    def __call__(self, output_token_ids: list[int], logits):
        """Return ``logits`` with every disallowed token at -inf (in place)."""
        import torch

        if self.matcher.is_stopped():
            return logits
        self._llt.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        # unpack the int32 bitmask: bit j of word i allows token 32 * i + j
        words = self._bitmask[0]
        bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.flatten()[: logits.shape[-1]].bool()
        logits.masked_fill_(~allowed.to(logits.device), float("-inf"))
        return logits

    def accept(self, token_id: int) -> None:
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token_id)

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_accepting()
