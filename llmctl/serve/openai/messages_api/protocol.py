"""``/v1/messages`` request bodies, validated (Anthropic's shapes, as the ``anthropic``
SDK sends them).

Unknown fields are a 400 naming them, as on the OpenAI routes. Fields Anthropic defines
that this server does not implement (server tools, ``container``, ``output_config``,
image and document blocks, ...) are a 400 naming them too, never silently ignored; a
value that asks for nothing (a null, ``speed: "standard"``) is taken. Accepted as the
hints they are: ``cache_control`` (the prefix cache is automatic), ``metadata``
(``user_id`` becomes the chat request's ``user``) and ``service_tier`` (one tier here).
``thinking`` is taken when it maps onto the chat path (:mod:`.convert`).
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

from llmctl.serve.core.sampling_params import INT64_MAX
from llmctl.serve.openai.protocol import (
    MAX_MESSAGES,
    MAX_STOP,
    MAX_TOOLS,
    FunctionName,
    NonEmptyStr,
    _Strict,
)

# Anthropic's fields that ask for something llmctl does not do, and the values that do
# not ask for it (accepted: a client that always sends them still works)
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "container": (None,), "context_management": (None,), "diagnostics": (None,),
    "inference_geo": (None,), "mcp_servers": (None, []), "output_config": (None,),
    "speed": (None, "standard"),
}

# the content block types each role's messages take here, and those Anthropic has
_BLOCKS = {"user": ("text", "tool_result"), "system": ("text",),
           "assistant": ("text", "tool_use", "thinking")}
_UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "redacted_thinking",
                       "server_tool_use", "web_search_tool_result", "container_upload",
                       "mcp_tool_use", "mcp_tool_result")


class CacheControl(_Strict):
    """A prompt-caching breakpoint: taken, the prefix cache needs none."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None  # citations come from documents, which are not taken


class ToolUseBlock(_Strict):
    """A tool call of an earlier answer, sent back."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value):
        if isinstance(value, list):
            for i, block in enumerate(value):
                kind = block.get("type") if isinstance(block, dict) else None
                if kind != "text":
                    what = "is not supported by this server" if kind in _UNSUPPORTED_BLOCKS \
                        else "is not a content block type here"
                    raise ValueError(f"tool_result content block {i} is of type {kind!r}, "
                                     f"which {what} (it takes text)")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(block.text for block in self.content)


class ThinkingBlock(_Strict):
    """An earlier answer's thinking, sent back (its signature is not checked: this
    server signs nothing)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")],
    Discriminator(lambda v: v.get("type") if isinstance(v, dict) else getattr(v, "type",
                                                                              None))]


_BLOCK_CLASSES: dict[str, type[_Strict]] = {
    "text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock}


def _check_block(i: int, cls: type[_Strict], block: dict, what: str = "content") -> None:
    """One clear message for a block's first problem, instead of one per member of the
    content union (a string, or a list of blocks)."""
    try:
        cls.model_validate(block)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            problem = "unrecognized field"
        elif err["type"] == "missing":
            problem = "missing required field"
        else:
            problem = str(err["ctx"]["error"]) if err["type"] == "value_error" \
                else err["msg"]
        raise ValueError(f"{what} block {i} ({block.get('type')}): "
                         f"{where + ': ' if where else ''}{problem}") from None


class InputMessage(_Strict):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, value, info):
        """One clear message per block this role does not take, instead of pydantic's
        tag error."""
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            # ValueError, not TypeError: pydantic makes only the former a 400
            raise ValueError("must be a string or a list of content blocks")  # noqa: TRY004
        role = info.data.get("role", "user")
        takes = _BLOCKS.get(role, ())
        for i, block in enumerate(value):
            if not isinstance(block, dict):
                raise ValueError(f"content block {i} must be an object")  # noqa: TRY004
            kind = block.get("type")
            if kind not in takes:
                what = "is not supported by this server" if kind in _UNSUPPORTED_BLOCKS \
                    else f"is not a content block type of {role} messages"
                raise ValueError(f"content block {i} is of type {kind!r}, which {what} "
                                 f"(it takes {', '.join(takes)})")
            _check_block(i, _BLOCK_CLASSES[kind], block)
        return value

    def blocks(self) -> list:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class ToolDef(_Strict):
    """A client ("custom") tool; server tools are refused before this is validated."""

    name: FunctionName
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None

    @field_validator("input_schema")
    @classmethod
    def _object(cls, value):
        if value.get("type") != "object":
            raise ValueError('must be a JSON schema of "type": "object"')
        return value


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('name is given with type "tool", and only then')
        return self


class ThinkingConfig(_Strict):
    """``enabled`` and ``adaptive`` need the server's --reasoning-parser; the thinking
    is then returned as thinking blocks. ``budget_tokens`` bounds it only through
    ``max_tokens`` (the engine has no separate thinking budget)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized"] | None = None  # the whole thinking is a summary too

    @model_validator(mode="after")
    def _budget(self):
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError('type "enabled" needs budget_tokens')
        if self.type != "enabled" and self.budget_tokens is not None:
            raise ValueError('budget_tokens goes with type "enabled" only')
        return self


class Metadata(_Strict):
    user_id: str | None = None


class _Conversation(_Strict):
    """What /v1/messages and /v1/messages/count_tokens both take."""

    model: str
    messages: list[InputMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    cache_control: CacheControl | None = None
    # refused unless neutral (_NEUTRAL): declared so the 400 can name them
    container: Any = None
    context_management: Any = None
    diagnostics: Any = None
    inference_geo: Any = None
    mcp_servers: Any = None
    output_config: Any = None
    speed: Any = None

    @field_validator(*_NEUTRAL, mode="before")
    @classmethod
    def _unsupported(cls, value, info):
        if value not in _NEUTRAL[info.field_name]:
            raise ValueError(f"{value!r} is not supported by this server; leave it out")
        return value

    @field_validator("system", mode="before")
    @classmethod
    def _system_text(cls, value):
        if isinstance(value, list):
            for i, block in enumerate(value):
                kind = block.get("type") if isinstance(block, dict) else None
                if kind != "text":
                    raise ValueError(f"system block {i} is of type {kind!r}; the system "
                                     "prompt takes text blocks")
                _check_block(i, TextBlock, block, "system")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _custom_tools_only(cls, value):
        for i, tool in enumerate(value if isinstance(value, list) else ()):
            if not isinstance(tool, dict):
                raise ValueError(f"tool {i} must be an object")  # noqa: TRY004 (a 400)
            kind = tool.get("type")
            if kind not in (None, "custom"):
                raise ValueError(f"tool {i} is of type {kind!r}: server tools are not "
                                 "supported by this server, only custom tools (name, "
                                 "description, input_schema)")
        return value

    @model_validator(mode="after")
    def _tools(self):
        names = [tool.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"tools: the tool name {dup!r} appears twice")
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not self.tools:
            raise ValueError(f'tool_choice "{choice.type}" needs tools: list them in tools')
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice names the tool {choice.name!r}, which is not in "
                             f"tools ({', '.join(names)})")
        return self

    def system_text(self) -> str:
        if self.system is None or isinstance(self.system, str):
            return self.system or ""
        return "\n".join(block.text for block in self.system)


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: list[NonEmptyStr] | None = Field(None, max_length=MAX_STOP)
    temperature: float | None = Field(None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=INT64_MAX)
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here
    priority: int = 0  # llmctl's (as chat's): the scheduling priority

    @model_validator(mode="after")
    def _budget_under_max_tokens(self):
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise ValueError(f"thinking.budget_tokens ({budget}) must be less than "
                             f"max_tokens ({self.max_tokens})")
        return self


class CountTokensRequest(_Conversation):
    """``/v1/messages/count_tokens``: the conversation without sampling fields."""
