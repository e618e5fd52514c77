"""Structured outputs: every form a request may constrain its output with, as one
grammar source for :class:`~llmctl.serve.sample.grammar.GrammarFactory`.

Three ways in, at most one per request (two would each set the output's shape):

- ``response_format``: OpenAI's ``json_object`` / ``json_schema``;
- ``structured_outputs`` (vLLM >= 0.10): exactly one of ``json`` (a schema, or its JSON
  text), ``regex``, ``choice`` (a list of strings), ``grammar`` (Lark, or GBNF/EBNF as
  llama.cpp writes it: llguidance converts it) or ``json_object: true``;
- vLLM's older top-level fields ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar``, which clients written before 0.10 still send in ``extra_body``
  (vLLM itself now ignores them silently: here they keep working).

Shape errors are pydantic's (the request's 400 names the field); conflicts between the
ways in are found by :func:`structured_form` and name the field that was one too many.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from llmctl.serve.openai import errors

MAX_CHOICES = 1024


def _schema(value: dict[str, Any] | str) -> dict[str, Any]:
    """A schema sent as JSON text (what vLLM's docs show) is parsed here, so the
    grammar factory sees one type and a malformed text is a 400 naming the field."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"is not a JSON schema: {exc}") from None
        except RecursionError:
            raise ValueError("is not a JSON schema: nested too deeply") from None
        if not isinstance(value, dict):
            # pydantic turns ValueError (not TypeError) into the 400 naming the field
            raise ValueError("must be a JSON schema: an object, or its JSON text")  # noqa: TRY004
    return value


JsonForm = Annotated[dict[str, Any] | str, AfterValidator(_schema)]
RegexForm = Annotated[str, Field(min_length=1)]
ChoiceForm = Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)]
GrammarForm = Annotated[str, Field(min_length=1)]

# form -> the grammar kind llmctl.serve.sample.grammar compiles it as
_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
          "json_object": "json_object"}
LEGACY_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` object; its other options (``structural_tag``,
    ``whitespace_pattern``, ``disable_additional_properties``) are refused by name."""

    model_config = ConfigDict(extra="forbid")
    json_: JsonForm | None = Field(None, alias="json")
    regex: RegexForm | None = None
    choice: ChoiceForm | None = None
    grammar: GrammarForm | None = None
    json_object: bool | None = None
    # JSON is always compact here (no free whitespace): what this asks, so it is taken
    disable_any_whitespace: bool = False

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [name for name in _KINDS if self.value(name) is not None]
        if len(given) != 1:
            found = f"got {', '.join(given)}" if given else "got none"
            raise ValueError(f"needs exactly one of json, regex, choice, grammar or "
                             f"json_object; {found}")
        if self.json_object is False:
            raise ValueError("json_object must be true when given")
        return self

    def value(self, name: str) -> Any:
        return self.json_ if name == "json" else getattr(self, name)

    def form(self) -> tuple[str, Any]:
        return next((name, self.value(name)) for name in _KINDS if self.value(name) is not None)


@dataclass(frozen=True)
class StructuredForm:
    """One request's grammar source: a GrammarFactory kind, its source, and the request
    field that asked for it (what a refusal names)."""

    kind: str
    source: Any
    param: str


def structured_form(req) -> StructuredForm | None:
    """The request's one grammar source, None if it asks for none; a 400 naming the
    extra field when it asks in more than one way."""
    asked: list[StructuredForm] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type != "text":
        schema = fmt.json_schema.schema_ if fmt.json_schema else None
        asked.append(StructuredForm(fmt.type, schema, "response_format"))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        name, value = so.form()
        asked.append(StructuredForm(_KINDS[name], value, "structured_outputs"))
    for field, name in LEGACY_FIELDS.items():
        if (value := getattr(req, field, None)) is not None:
            asked.append(StructuredForm(_KINDS[name], value, field))
    if len(asked) > 1:
        names = [form.param for form in asked]
        raise errors.bad_request(
            f"{names[-1]} cannot be combined with {', '.join(names[:-1])}: each sets the "
            "output's shape; send one", names[-1])
    return asked[0] if asked else None


def compiles_grammar(req) -> bool:
    """Whether preparing ``req`` compiles a grammar (tool schemas included): then it is
    prepared beside the event loop, as compiling waits on the compile pool."""
    fmt = getattr(req, "response_format", None)
    return bool(getattr(req, "structured_outputs", None) is not None
                or (fmt is not None and fmt.type != "text")
                or getattr(req, "tools", None)
                or any(getattr(req, field, None) is not None for field in LEGACY_FIELDS))
