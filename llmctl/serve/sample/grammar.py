"""Constrained decoding for ``response_format`` through llguidance.

llguidance compiles a JSON schema (or "any JSON object") to a grammar and, for each
step, gives the set of tokens that keep the output a valid prefix
(``fill_next_token_bitmask``: one bit per token, cheap enough to run every step on CPU;
it is a Rust extension). :class:`JsonConstraint` is one sequence's matcher behind the
engine's :class:`~llmctl.serve.core.constraints.LogitsConstraint` protocol;
:class:`CompiledGrammar` is the per-request factory the engine calls once per sequence.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from llmctl.errors import MissingDependencyError

_ANY_OBJECT = {"type": "object"}

# The factory of this process, where grammars arriving from another process compile
# (an engine process: llmctl.serve.proc.child). A compiled grammar pickles as its text,
# since llguidance's tokenizer wrapper does not pickle and is per process anyway.
_PROCESS_FACTORY: GrammarFactory | None = None


def install_process_factory(factory: GrammarFactory) -> None:
    global _PROCESS_FACTORY
    _PROCESS_FACTORY = factory


def _unpickle_grammar(grammar: str) -> CompiledGrammar:
    if _PROCESS_FACTORY is None:
        raise RuntimeError("a grammar arrived in a process without a grammar factory")
    return CompiledGrammar(_PROCESS_FACTORY, grammar)


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
        self.eos_token_id = hf_tokenizer.eos_token_id

    def grammar_for(self, kind: str, schema: dict[str, Any] | None) -> str:
        """Compile now so an invalid schema is a 400 before anything is queued."""
        schema = schema if kind == "json_schema" else _ANY_OBJECT
        try:
            grammar = self._llg.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults={"whitespace_flexible": False})
            problem = self._llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        except Exception as exc:  # noqa: BLE001 - the schema is the client's: so is the fault
            raise ValueError(f"unsupported JSON schema: {type(exc).__name__}: {exc}") from None
        if problem:  # an empty string means the grammar is usable
            raise ValueError(f"unsupported JSON schema: {problem}")
        return grammar

    def compiled(self, kind: str, schema: dict[str, Any] | None) -> CompiledGrammar:
        """The engine-facing factory for ``response_format`` (raises ValueError if bad)."""
        return CompiledGrammar(self, self.grammar_for(kind, schema))

    def constraint(self, grammar: str) -> JsonConstraint:
        return JsonConstraint(self._llg.LLMatcher(self.tokenizer, grammar), self.vocab_size,
                              self.eos_token_id)


class CompiledGrammar:
    """One request's grammar: a fresh matcher per sequence (a ConstraintFactory)."""

    def __init__(self, factory: GrammarFactory, grammar: str) -> None:
        self.factory = factory
        self.grammar = grammar

    def new_constraint(self) -> JsonConstraint:
        return self.factory.constraint(self.grammar)

    def __reduce__(self):
        return _unpickle_grammar, (self.grammar,)

    def __repr__(self) -> str:
        return f"CompiledGrammar({len(self.grammar)} chars)"


class JsonConstraint:
    """Per-sequence state: masks logits to tokens the grammar allows next."""

    def __init__(self, matcher, vocab_size: int, eos_token_id: int | None) -> None:
        import llguidance.torch as llt

        self._llt = llt
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._bitmask = llt.allocate_token_bitmask(1, vocab_size)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """Bool ``[vocab_size]``: the tokens the grammar accepts next."""
        self._llt.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        # unpack the int32 bitmask: bit j of word i allows token 32 * i + j
        bits = (self._bitmask[0].unsqueeze(-1) >> self._shifts) & 1
        return bits.flatten()[: self.vocab_size].bool()

    def mask(self, logits: torch.Tensor) -> None:
        if self.matcher.is_error():
            # a token the mask did not allow got in (cannot happen through the engine):
            # only EOS is safe
            keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            if self.eos_token_id is not None and self.eos_token_id < logits.shape[-1]:
                keep[self.eos_token_id] = True
        else:
            allowed = self.allowed()
            vocab = logits.shape[-1]
            keep = torch.zeros(vocab, dtype=torch.bool)
            n = min(vocab, allowed.shape[0])
            keep[:n] = allowed[:n]
            keep = keep.to(logits.device)
        if bool(keep.any()):
            logits.masked_fill_(~keep, float("-inf"))

    def accept(self, token_id: int) -> None:
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token_id)

    def is_finished(self) -> bool:
        return self.matcher.is_stopped()
