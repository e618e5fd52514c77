"""OpenAI request bodies, validated.

Unknown fields are rejected with 400, as OpenAI does ("Unrecognized request
argument"); the vLLM extensions that benchmark tools send (``top_k``, ``min_p``,
``ignore_eos``, ``repetition_penalty``, ``priority``) are accepted. Fields OpenAI
defines that llmctl does not implement are listed in ``UNSUPPORTED`` and refused with
a message saying so, rather than silently ignored.

``logit_bias`` maps token ids (JSON object keys, so strings of integers) to a bias in
``[-100, 100]``, at most 300 of them (OpenAI's limits); the server checks the ids against
the vocabulary. ``structured_outputs`` (and vLLM's older ``guided_*`` fields) constrain
the output with a schema, regex, choice or grammar (:mod:`llmctl.serve.openai.structured`).
Chat requests may carry function ``tools`` and a ``tool_choice``
(:mod:`llmctl.serve.openai.tools.request` turns them into a template argument, a grammar or a
parser), and messages carry ``tool_calls`` (assistant) and ``tool_call_id`` (tool).

``echo`` (completions) returns the prompt before the completion and, with ``logprobs``,
the prompt tokens' log-probs (the first is null); ``max_tokens: 0`` is allowed with it
(prompt only, what lm-eval's loglikelihood requests send). ``return_tokens_as_token_ids``
(a vLLM extension) names logprob tokens ``token_id:N`` instead of their text.

Every number is bounded and every list capped, so no value reaches the engine that it
cannot take (a client's mistake is a 400, never a 500 or another request's failure):
floats must be finite (``NaN``/``Infinity`` are not JSON either: the parser refuses
them), ``seed`` is a 64-bit integer (what ``torch.Generator`` takes, see
:class:`~llmctl.serve.core.sampling_params.SamplingParams`), ``0 < top_p <= 1``, and the
lists below are at most ``MAX_*`` long. ``max_tokens`` is bounded by the context length
once the prompt is tokenized.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from llmctl.serve.core.sampling_params import (
    INT64_MAX,
    LOGIT_BIAS_LIMIT,
    MAX_LOGIT_BIAS_ENTRIES,
    SEED_MAX,
    SEED_MIN,
)
from llmctl.serve.openai.structured import (
    ChoiceForm,
    GrammarForm,
    JsonForm,
    RegexForm,
    StructuredOutputs,
)

NonEmptyStr = Annotated[str, Field(min_length=1)]

MAX_PROMPTS = 1024  # prompts in one completions request (lists of strings or of id lists)
MAX_STOP = 64  # stop strings
MAX_STOP_TOKEN_IDS = 1024
MAX_MESSAGES = 4096  # chat messages
MAX_TOOLS = 128  # function tools in one request (OpenAI's limit)
MAX_TOOL_CALLS = 128  # tool calls in one assistant message

TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def allowed_range(model: type[BaseModel], name: str) -> str | None:
    """``"0 < top_p <= 1"``: the bounds a numeric field declares, for error messages."""
    field = model.model_fields.get(name)
    if field is None:
        return None
    low = high = ""
    for bound in field.metadata:  # annotated_types' Ge, Gt, Le, Lt
        if getattr(bound, "ge", None) is not None:
            low = f"{bound.ge} <= "
        if getattr(bound, "gt", None) is not None:
            low = f"{bound.gt} < "
        if getattr(bound, "le", None) is not None:
            high = f" <= {bound.le}"
        if getattr(bound, "lt", None) is not None:
            high = f" < {bound.lt}"
    return f"{low}{name}{high}" if low or high else None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaSpec(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.schema_ is None):
            raise ValueError("response_format type json_schema needs json_schema.schema")
        return self


class _SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=INT64_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    priority: int = 0
    response_format: ResponseFormat | None = None
    # vLLM's structured outputs, and its older top-level names for the same forms
    # (llmctl.serve.openai.structured: at most one way in per request)
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonForm | None = None
    guided_regex: RegexForm | None = None
    guided_choice: ChoiceForm | None = None
    guided_grammar: GrammarForm | None = None
    logit_bias: dict[str, float] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    return_tokens_as_token_ids: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_count(cls, value):
        if isinstance(value, list) and len(value) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(value)}")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_count(cls, value):
        if isinstance(value, dict) and len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} tokens may be biased, "
                             f"got {len(value)}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_entries(cls, value):
        for key, bias in (value or {}).items():
            if not key.strip().isdigit():  # "-1", "1.5", "a": not a token id
                raise ValueError(f"key {key!r} is not a token id (a non-negative integer)")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"bias {bias!r} for token {key} is out of range; allowed: "
                                 f"-100 <= bias <= 100")
        return value

    @property
    def logit_bias_ids(self) -> dict[int, float] | None:
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    @model_validator(mode="after")
    def _checks(self):
        if isinstance(self.stop, list) and any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        """One clear message instead of one per member of the union."""
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise ValueError("prompt must be a string, a list of strings, a list of token "
                             "ids or a list of token-id lists, and not empty")
        if all(_is_int(x) for x in value):
            return value  # one prompt of token ids: the context length bounds it
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}")
        if not (all(isinstance(x, str) for x in value)
                or all(isinstance(x, list) and all(_is_int(t) for t in x) for x in value)):
            raise ValueError("a list of prompts must be all strings or all token-id lists")
        return value

    @model_validator(mode="after")
    def _prompt(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        return self

    @model_validator(mode="after")
    def _echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 is only allowed with echo=true (prompt only)")
        return self

    @property
    def prompt_only(self) -> bool:
        """Echo without generation: the engine still samples one token, dropped here."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


# OpenAI's rule for function names (and vLLM's templates rely on plain names too)
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class FunctionCallParam(_Strict):
    name: str
    arguments: str  # JSON text, as the API returned it


class ToolCallParam(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(BaseModel):
    # ``name`` and tool fields are passed to the template; other keys are refused.
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = Field(None, max_length=MAX_TOOL_CALLS)
    tool_call_id: str | None = None
    # an earlier answer's thinking, as the server returned it (both names, as vLLM
    # takes them); templates that keep it read ``reasoning_content``
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id belongs to tool messages")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' conventions)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if reasoning := self.reasoning_content or self.reasoning:
            message["reasoning_content"] = reasoning
        if self.tool_calls:
            # templates (Hermes, Qwen2.5, Llama 3.1) write arguments with ``tojson``: they
            # expect an object, so JSON text is parsed first (as vLLM does); text that is
            # not JSON is passed on as it is
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name,
                              "arguments": _json_or_text(call.function.arguments)}}
                for call in self.tool_calls]
        return message


def _json_or_text(text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDef(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


_TOOL_CHOICES = ("none", "auto", "required")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # extra variables for the chat template (e.g. {"enable_thinking": false}), over the
    # server's --default-chat-template-kwargs
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value):
        """One clear message instead of one per member of the union."""
        if isinstance(value, dict):
            try:
                return NamedToolChoice.model_validate(value)
            except ValidationError:
                pass
        elif value is None or value in _TOOL_CHOICES:
            return value
        raise ValueError('must be "none", "auto", "required" or {"type": "function", '
                         '"function": {"name": NAME}}')

    @model_validator(mode="after")
    def _chat(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.max_tokens == 0:
            raise ValueError("max_tokens must be at least 1")
        return self

    @model_validator(mode="after")
    def _tools(self):
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"tools: the function name {dup!r} appears twice")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools: list the functions in tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, "
                             f"which is not in tools ({', '.join(names)})")
        return self

    @property
    def tool_mode(self) -> str:
        """none | auto | required | named: OpenAI's default is auto when tools are given."""
        if not self.tools:
            return "none"
        choice = self.tool_choice or "auto"
        return "named" if isinstance(choice, NamedToolChoice) else choice

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --- /tokenize and /detokenize (vLLM's shapes: its benchmark client aligns tokenizers
# with them before a run) ------------------------------------------------------------------
class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # e.g. BOS, as /v1/completions adds them
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # on top of what the chat template writes
    chat_template_kwargs: dict[str, Any] | None = None  # as chat completions take them
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_ending(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both "
                             "be true")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


def tokenize_request_class(body: dict) -> type[BaseModel]:
    """/tokenize takes either shape; ``messages`` names the chat one (as vLLM's does)."""
    return TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest


# --- /v1/embeddings ------------------------------------------------------------------------
MAX_EMBEDDING_INPUTS = 2048  # inputs in one embeddings request (OpenAI's limit)


class EmbeddingRequest(_Strict):
    """OpenAI's fields, and vLLM's extensions ``add_special_tokens``, ``use_activation``
    (normalise or not, over the server's default) and ``priority``."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # at most the hidden size (the frontend)
    user: str | None = None
    add_special_tokens: bool = True
    use_activation: bool | None = None
    priority: int = 0

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value):
        """One clear message instead of one per member of the union; an empty text or
        token list has nothing to embed (OpenAI refuses it too)."""
        shape = ("input must be a string, a list of strings, a list of token ids or a list "
                 "of token-id lists")
        if isinstance(value, str):
            if not value:
                raise ValueError("input must not be an empty string")
            return value
        if not isinstance(value, list) or not value:
            raise ValueError(f"{shape}, and not empty")
        if all(_is_int(x) for x in value):
            return value
        if len(value) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request, got "
                             f"{len(value)}")
        if not (all(isinstance(x, str) for x in value)
                or all(isinstance(x, list) and all(_is_int(t) for t in x) for x in value)):
            raise ValueError(f"{shape}; a list must be all strings or all token-id lists")
        if any(not x for x in value):
            raise ValueError("input must not contain an empty string or token list")
        return value

    @property
    def stream(self) -> bool:
        return False  # one body per request (what `llmctl batch` asks of every line)

    def inputs(self) -> list[str | list[int]]:
        """One entry per input: text, or token ids."""
        x = self.input
        if isinstance(x, str):
            return [x]
        if all(isinstance(t, int) for t in x):
            return [list(x)]
        return list(x)
