"""``/v1/responses`` request bodies, validated (OpenAI's shapes, as the ``openai`` SDK
sends them).

As in :mod:`llmctl.serve.openai.protocol`, unknown fields are a 400 naming them. Fields
OpenAI defines that this server does not implement (built-in tools, ``background``,
``include``, image and file inputs, ...) are a 400 naming them too, rather than
silently ignored; a value that asks for nothing (``background: false``, ``include: []``,
``truncation: "disabled"``, a null) is taken, since some clients always send one.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from llmctl.serve.openai.protocol import (
    MAX_MESSAGES,
    MAX_TOOLS,
    FunctionName,
    _Strict,
)

# OpenAI's fields that ask for something llmctl does not do, and the values that do not
# ask for it (accepted: a client that always sends them still works)
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "background": (None, False), "background_options": (None,),
    "context_management": (None, []), "conversation": (None,), "include": (None, []),
    "max_tool_calls": (None,), "moderation": (None,), "prompt": (None,),
    "reasoning": (None,), "service_tier": (None, "auto", "default"),
    "stream_options": (None,), "top_logprobs": (None, 0), "truncation": (None, "disabled"),
}

# input item and content part types OpenAI has and this server does not take
_UNSUPPORTED_PARTS = ("input_image", "input_file", "input_audio", "refusal")
_PART_TYPES = ("input_text", "output_text")
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class InputText(_Strict):
    type: Literal["input_text", "output_text"]  # output_text: an earlier answer sent back
    text: str
    annotations: list[Any] | None = None  # output_text's, as the server returned them
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None  # an output message sent back as input carries these
    status: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value):
        """One clear message instead of one per member of the union."""
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            # ValueError, not TypeError: pydantic makes only the former a 400
            raise ValueError("must be a string or a list of content parts")  # noqa: TRY004
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in _PART_TYPES:
                what = "is not supported by this server" if kind in _UNSUPPORTED_PARTS \
                    else "is not a content part type"
                raise ValueError(f"content part {i} is of type {kind!r}, which {what} "
                                 f"(it takes {', '.join(_PART_TYPES)})")
        return value

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str  # JSON text, as the server returned it
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Strict):
    """An earlier answer's thinking, sent back: it goes with the next assistant turn."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: None = None  # this server never hands out encrypted reasoning
    status: str | None = None

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "".join(part.text for part in parts)


def _item_type(value: Any) -> str | None:
    """An item's tag: its ``type``, or "message" for the short ``{role, content}`` form."""
    if isinstance(value, dict):
        return value.get("type") or ("message" if "role" in value else None)
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type)]


class FunctionTool(_Strict):
    """A function tool in the Responses shape: flat, not nested under ``function``."""

    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.schema_ is None or not self.name):
            raise ValueError("format type json_schema needs a name and a schema")
        return self


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: None = None  # OpenAI's hint to its own models; nothing to do here


class ResponsesRequest(_Strict):
    model: str | None = None
    input: list[InputItem]  # a string is taken as one user message
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None  # None: true, as OpenAI's default
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)  # echoed back
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint; the prefix cache is automatic
    priority: int = 0  # llmctl's (as chat's): the scheduling priority
    # refused unless neutral (_NEUTRAL): declared so the 400 can name them
    background: Any = None
    background_options: Any = None
    context_management: Any = None
    conversation: Any = None
    include: Any = None
    max_tool_calls: Any = None
    moderation: Any = None
    prompt: Any = None
    reasoning: Any = None
    service_tier: Any = None
    stream_options: Any = None
    top_logprobs: Any = None
    truncation: Any = None

    @field_validator(*_NEUTRAL, mode="before")
    @classmethod
    def _unsupported(cls, value, info):
        if isinstance(value, dict) and all(v is None for v in value.values()):
            return None  # {} or all nulls (reasoning: {"effort": null}) asks for nothing
        if value not in _NEUTRAL[info.field_name]:
            raise ValueError(f"{value!r} is not supported by this server; leave it out")
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value):
        """A string as one user message; one clear message per unsupported item, instead
        of pydantic's tag error."""
        if value == "" or value == []:
            raise ValueError("input must not be empty")
        if isinstance(value, str):
            return [{"type": "message", "role": "user", "content": value}]
        if isinstance(value, list):
            if len(value) > MAX_MESSAGES:
                raise ValueError(f"at most {MAX_MESSAGES} items, got {len(value)}")
            for i, item in enumerate(value):
                if not isinstance(item, dict):
                    raise ValueError(f"item {i} must be an object")  # noqa: TRY004 (a 400)
                kind = _item_type(item)
                if kind not in _ITEM_TYPES:
                    raise ValueError(f"item {i} is of type {kind!r}, which this server does "
                                     f"not support (it takes {', '.join(_ITEM_TYPES)})")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value):
        """One clear message instead of one per member of the union."""
        if value is None or value in ("none", "auto", "required"):
            return value
        if isinstance(value, dict):
            try:
                return NamedFunction.model_validate(value)
            except ValidationError:
                pass
        raise ValueError('must be "none", "auto", "required" or {"type": "function", '
                         '"name": NAME} (built-in tool choices are not supported)')

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value):
        for i, tool in enumerate(value if isinstance(value, list) else ()):
            if not isinstance(tool, dict):
                raise ValueError(f"tool {i} must be an object")  # noqa: TRY004 (a 400)
            kind = tool.get("type")
            if kind != "function":
                raise ValueError(f"tool {i} is of type {kind!r}: built-in tools are not "
                                 "supported by this server, only function tools")
        return value

    @model_validator(mode="after")
    def _tools(self):
        names = [tool.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"tools: the function name {dup!r} appears twice")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools: list the functions in tools")
        if isinstance(choice, NamedFunction) and choice.name not in names:
            raise ValueError(f"tool_choice names the function {choice.name!r}, which is "
                             f"not in tools ({', '.join(names)})")
        return self

    @property
    def stores(self) -> bool:
        return self.store is not False

