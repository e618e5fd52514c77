"""Function tools in chat requests: what a request's ``tools``/``tool_choice`` ask of the
prompt, the sampler and the response, as vLLM and OpenAI answer them.

=====================  ==================================  ==========================
``tool_choice``        generation                          ``message``
=====================  ==================================  ==========================
``"none"``             free                                content only
``"auto"`` (default    free; the server's ``--tool-call-   calls the parser finds,
with tools)            parser`` reads calls out of it      the rest as content
``"required"``         a grammar: a JSON array of one or   ``tool_calls``, content
                       more ``{"name", "parameters"}``     null
                       (vLLM's schema), any of the tools
named function         a grammar: that tool's parameters   one call to it
=====================  ==================================  ==========================

The tools are passed to the chat template (``apply_chat_template(tools=...)``) in every
mode, as vLLM does; a template that does not render them (it never mentions ``tools``)
leaves the model unaware of them: "required" and named calls are still well-formed,
since the grammar writes their shape, but "auto" depends on the model calling by
itself. The server logs this once per template. ``"auto"`` needs the server started
with ``--enable-auto-tool-choice --tool-call-parser NAME`` (vLLM's flags and rule).

A call is announced with ``finish_reason: "tool_calls"`` (unless the output was cut by
``max_tokens``: "length"); ``parallel_tool_calls: false`` keeps one call (for
"required" the grammar allows only one).
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from llmctl.serve.openai.tools.parsers import (
    CallArgs,
    CallStart,
    Event,
    NamedCallParser,
    RequiredCallsParser,
    Text,
    ToolCallParser,
    auto_parser,
)

log = logging.getLogger("llmctl.serve")

_NO_ARGUMENTS = {"type": "object", "properties": {}}


class ToolRequestError(ValueError):
    """A request's tools cannot be honoured: a 400 naming ``param``."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def template_tools(req) -> list[dict[str, Any]] | None:
    """The tools as ``apply_chat_template`` takes them (OpenAI's shape, unset keys out)."""
    tools = getattr(req, "tools", None)  # /tokenize's chat requests have none
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


def required_schema(tools, parallel: bool) -> dict[str, Any]:
    """vLLM's schema for ``tool_choice: "required"``: a non-empty array of calls, each
    ``{"name": one tool's name, "parameters": that tool's parameters}``."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": t.function.parameters or _NO_ARGUMENTS},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass
class ToolPlan:
    """What one chat request's tools change: sampling, and how each choice is read."""

    mode: str = "none"  # none | auto | required | named
    constraint: Any = None  # a ConstraintFactory (required, named)
    parser: type | None = None  # an AUTO_PARSERS class (auto)
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def sampling_overrides(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.constraint is not None:
            extra["logits_constraint"] = self.constraint
        if self.parser is not None and not self.parser.skip_special_tokens:
            extra["skip_special_tokens"] = False
        return extra

    def new_choice(self) -> ChoiceTools:
        parsers = {"auto": lambda: self.parser(), "required": RequiredCallsParser,
                   "named": lambda: NamedCallParser(self.name)}
        return ChoiceTools(parsers[self.mode](), self.parallel)


def plan_tools(req, grammars, auto_parser_name: str | None) -> ToolPlan:
    """The plan for a chat request; raises :class:`ToolRequestError`. ``grammars`` is
    the server's GrammarFactory (None without llguidance)."""
    mode = req.tool_mode
    parallel = req.parallel_tool_calls is not False
    if req.tools and grammars is not None:
        for i, tool in enumerate(req.tools):  # a bad schema is a 400 in every mode
            if tool.function.parameters is not None:
                _grammar(grammars, tool.function.parameters, f"tools.{i}.function.parameters")
    if mode == "none":
        return ToolPlan()
    if mode == "auto":
        if auto_parser_name is None:
            raise ToolRequestError(
                'tool_choice "auto" (the default when tools are given) needs '
                "--enable-auto-tool-choice --tool-call-parser NAME (llmctl serve or batch); "
                'send tool_choice "required", a named function or "none" instead',
                "tool_choice")
        return ToolPlan("auto", parser=auto_parser(auto_parser_name), parallel=parallel)
    if grammars is None:
        raise ToolRequestError(f'tool_choice "{mode}" is not available on this server '
                               "(llguidance is not installed)", "tool_choice")
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        raise ToolRequestError("response_format cannot be combined with tool_choice "
                               '"required" or a named function: both set the output\'s '
                               "shape", "response_format")
    if mode == "required":
        schema = required_schema(req.tools, parallel)
        return ToolPlan("required", _grammar(grammars, schema, "tools"), parallel=parallel)
    name = req.tool_choice.function.name
    tool = next(t for t in req.tools if t.function.name == name)
    schema = tool.function.parameters or _NO_ARGUMENTS
    return ToolPlan("named", _grammar(grammars, schema, "tools"), name=name)


def _grammar(grammars, schema: dict[str, Any], param: str):
    try:
        return grammars.compiled("json_schema", schema)
    except ValueError as exc:
        raise ToolRequestError(f"{param}: {exc}", param) from None


@dataclass
class ChoiceTools:
    """One choice's tool-call reading: text in, content and call deltas out, and the
    assembled message for non-streamed responses."""

    parser: ToolCallParser
    parallel: bool = True
    content: str = ""
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)

    def update(self, text: str, finish_reason: str | None
               ) -> tuple[str, list[dict[str, Any]], str | None]:
        """(content delta, tool-call deltas in OpenAI's stream shape, finish reason)."""
        events = self.parser.feed(text)
        if finish_reason is not None:
            events += self.parser.finish()
        content = "".join(e.text for e in events if isinstance(e, Text))
        self.content += content
        deltas = self._deltas(events)
        if finish_reason == "stop" and self.calls:
            finish_reason = "tool_calls"
        return content, deltas, finish_reason

    def _deltas(self, events: list[Event]) -> list[dict[str, Any]]:
        deltas: dict[int, dict[str, Any]] = {}  # one entry per call and chunk
        for e in events:
            if isinstance(e, Text) or (e.index > 0 and not self.parallel):
                continue
            if isinstance(e, CallStart):
                call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": e.name, "arguments": ""}}
                self.calls[e.index] = call
                deltas[e.index] = {"index": e.index, **call,
                                   "function": dict(call["function"])}
            elif isinstance(e, CallArgs) and e.index in self.calls:
                self.calls[e.index]["function"]["arguments"] += e.text
                delta = deltas.setdefault(e.index, {"index": e.index,
                                                    "function": {"arguments": ""}})
                delta["function"]["arguments"] += e.text
        return [deltas[i] for i in sorted(deltas)]

    @property
    def tool_calls(self) -> list[dict[str, Any]] | None:
        return [self.calls[i] for i in sorted(self.calls)] or None


_TEMPLATES_CHECKED: set[str] = set()


def warn_if_template_ignores_tools(tokenizer) -> None:
    """Log once per chat template when rendering tools changes nothing in the prompt."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return
    key = hashlib.sha256(template.encode()).hexdigest()
    if key in _TEMPLATES_CHECKED:
        return
    _TEMPLATES_CHECKED.add(key)
    probe = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "llmctl_probe", "parameters":
                                             _NO_ARGUMENTS}}
    try:
        plain = tokenizer.apply_chat_template(probe, tokenize=False)
        with_tools = tokenizer.apply_chat_template(probe, tools=[tool], tokenize=False)
    except Exception:  # noqa: BLE001 - only a hint; the request's own render reports errors
        return
    if plain == with_tools:
        log.warning("this model's chat template does not render tools: the model is not "
                    "told about them (tool_choice required/named still give well-formed "
                    "calls; auto relies on the model)")
