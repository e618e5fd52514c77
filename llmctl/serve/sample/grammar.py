"""Constrained decoding through llguidance: ``response_format``, tool grammars and every
``structured_outputs`` form (JSON schema, any JSON object, regex, choice, Lark/GBNF).

llguidance compiles a grammar once and, for each step, gives the set of tokens that
keep the output a valid prefix (``compute_bitmask``: one bit per token, cheap enough to
run every step on CPU; it is a Rust extension). :class:`GrammarFactory` compiles a
request's grammar on its :class:`~llmctl.serve.sample.compile_pool.CompilePool` (a large
stack, a time limit, never on the engine's step thread) into a template matcher;
:class:`CompiledGrammar` is the per-request factory the engine calls once per sequence,
which only copies that template; :class:`GrammarConstraint` is one sequence's matcher
behind the engine's :class:`~llmctl.serve.core.constraints.LogitsConstraint` protocol.

Limits: a grammar's source over :data:`MAX_SOURCE_CHARS` is refused before compiling;
llguidance's ``LLParserLimits`` (its defaults: lexer fuel, Earley items, lexer states,
grammar size) bound both the compile and each step; the pool bounds the wall time.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from llmctl.errors import MissingDependencyError
from llmctl.serve.sample.compile_pool import CompilePool

_ANY_OBJECT = {"type": "object"}

# the client's text a grammar is compiled from (schema JSON, regex, Lark, choices): above
# this the compile's time and stack grow past what a request may ask of the server
MAX_SOURCE_CHARS = 128 * 1024

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
_WHAT = {"json_schema": "unsupported JSON schema", "json_object": "JSON object grammar",
         "regex": "invalid regex", "choice": "invalid choice", "grammar": "invalid grammar"}

# The factory of this process, where grammars arriving from another process compile
# (an engine process: llmctl.serve.proc.child). A compiled grammar pickles as its text,
# since llguidance's matchers and tokenizer wrapper do not pickle and are per process.
_PROCESS_FACTORY: GrammarFactory | None = None


def install_process_factory(factory: GrammarFactory) -> None:
    global _PROCESS_FACTORY
    _PROCESS_FACTORY = factory


def _unpickle_grammar(grammar: str) -> CompiledGrammar:
    if _PROCESS_FACTORY is None:
        raise RuntimeError("a grammar arrived in a process without a grammar factory")
    return CompiledGrammar(_PROCESS_FACTORY, grammar)


def one_line(message: str, limit: int = 1000) -> str:
    """llguidance's message (multi-line, a source excerpt, a panic's backtrace) as one
    line for an error body."""
    message = message.split("<backtrace>")[0]
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return text if len(text) <= limit else text[:limit] + "..."


def source_chars(kind: str, source: Any) -> int:
    """How much text ``source`` is (the size limit's measure); ValueError if a schema is
    nested too deeply to serialise."""
    if isinstance(source, str):
        return len(source)
    if kind == "choice":
        return sum(len(choice) + 3 for choice in source)
    try:
        return len(json.dumps(source))
    except (RecursionError, ValueError, TypeError) as exc:
        raise ValueError(f"{_WHAT[kind]}: {type(exc).__name__}: {exc}") from None


class GrammarFactory:
    """Holds the tokenizer wrapper (built once per server) and compiles grammars."""

    def __init__(self, hf_tokenizer, vocab_size: int, pool: CompilePool | None = None) -> None:
        try:
            import llguidance
            import llguidance.hf
        except ImportError:
            raise MissingDependencyError(
                "structured output needs the llguidance package",
                "pip install 'llmctl[serve]' (llguidance)") from None
        self._llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size
        self.eos_token_id = hf_tokenizer.eos_token_id
        self.pool = pool if pool is not None else CompilePool()
        self.max_source_chars = MAX_SOURCE_CHARS

    def grammar_text(self, kind: str, source: Any) -> str:
        """llguidance's grammar for one form (``source``: the schema dict, the regex, the
        list of choices or the Lark/GBNF text; unused for json_object)."""
        new = self._llg.LLMatcher
        if kind in ("json_schema", "json_object"):
            schema = source if kind == "json_schema" else _ANY_OBJECT
            return new.grammar_from_json_schema(json.dumps(schema),
                                                defaults={"whitespace_flexible": False})
        if kind == "regex":
            return new.grammar_from_regex(source)
        if kind == "choice":  # Lark string literals take JSON's escapes
            return new.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in source))
        if kind == "grammar":
            from llguidance.gbnf_to_lark import any_to_lark  # Lark as it is, GBNF converted

            return new.grammar_from_lark(any_to_lark(source))
        raise ValueError(f"unknown grammar kind {kind!r}; known: {', '.join(KINDS)}")

    def matcher(self, grammar: str):
        """A compiled, unadvanced matcher (the template); ValueError with llguidance's
        message if it refuses the grammar or its first step overruns the step limits."""
        limits = self._llg.LLParserLimits(verbose_errors=False)
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits)
        if not matcher.is_error():
            probe = matcher.deep_copy()  # the first mask: the lazy lexer's first work
            probe.compute_bitmask()
            if probe.is_error():
                raise ValueError(one_line(probe.get_error()))
        if matcher.is_error():
            raise ValueError(one_line(matcher.get_error()))
        return matcher

    def compiled(self, kind: str, source: Any = None) -> CompiledGrammar:
        """The engine-facing factory for one form, compiled now on the pool so a bad or
        too complex grammar is refused before anything is queued: ValueError (the
        client's fault, :class:`~llmctl.serve.sample.compile_pool.CompileTimeoutError`
        among them) or :class:`~llmctl.serve.sample.compile_pool.CompileBusyError`."""
        if kind not in KINDS:
            raise ValueError(f"unknown grammar kind {kind!r}; known: {', '.join(KINDS)}")
        size = source_chars(kind, source) if kind != "json_object" else 0
        if size > self.max_source_chars:
            raise ValueError(f"{_WHAT[kind]}: {size} characters; this server compiles at "
                             f"most {self.max_source_chars}")

        def build() -> CompiledGrammar:
            try:
                grammar = self.grammar_text(kind, source)
                return CompiledGrammar(self, grammar, self.matcher(grammar))
            except Exception as exc:  # noqa: BLE001 - the grammar is the client's: so is the fault
                message = str(exc) if isinstance(exc, ValueError) else \
                    f"{type(exc).__name__}: {exc}"
                raise ValueError(f"{_WHAT[kind]}: {one_line(message)}") from None

        try:
            return self.pool.run(build)
        except ValueError as exc:
            if type(exc) is ValueError:
                raise
            raise type(exc)(f"{_WHAT[kind]}: {exc}") from None

    def constraint(self, matcher) -> GrammarConstraint:
        return GrammarConstraint(matcher, self.vocab_size, self.eos_token_id)


class CompiledGrammar:
    """One request's grammar: a copy of its compiled matcher per sequence (a
    ConstraintFactory). Copying is cheap and safe on the engine's step thread; compiling
    there would hold every sequence's step behind this one's grammar."""

    def __init__(self, factory: GrammarFactory, grammar: str, matcher=None) -> None:
        self.factory = factory
        self.grammar = grammar
        self._matcher = matcher  # the template, never advanced; None: not compiled yet

    def new_constraint(self) -> GrammarConstraint:
        if self._matcher is None:
            # unpickled in an engine process: compile once, on the pool's large stack;
            # the frontend compiled it within the limits already, so no time limit
            self._matcher = self.factory.pool.run(
                lambda: self.factory.matcher(self.grammar), limited=False)
        return self.factory.constraint(self._matcher.deep_copy())

    def __reduce__(self):
        return _unpickle_grammar, (self.grammar,)

    def __repr__(self) -> str:
        return f"CompiledGrammar({len(self.grammar)} chars)"


class GrammarConstraint:
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
            # a token the mask did not allow got in (cannot happen through the engine),
            # or a step overran llguidance's step limits: only EOS is safe
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


JsonConstraint = GrammarConstraint  # the name from when JSON was the only form
