"""Tool-call parsers on hand-written model outputs: whole, and fed in every chunking
(streamed and non-streamed answers come from the same parser, so they must agree)."""

import json

import pytest

from llmctl.serve.openai.tools.parsers import (
    AUTO_PARSERS,
    CallArgs,
    CallStart,
    HermesParser,
    Llama3JsonParser,
    NamedCallParser,
    RequiredCallsParser,
    Text,
)
from llmctl.serve.openai.tools.request import ChoiceTools


def _run(parser, text: str, step: int | None = None) -> list:
    events = []
    if step is None:
        events += parser.feed(text)
    else:
        for i in range(0, len(text), step):
            events += parser.feed(text[i:i + step])
    return events + parser.finish()


def _assemble(events) -> tuple[str, list[tuple[str, dict]]]:
    """(content, [(name, arguments)]), arguments decoded: pieces must join to JSON."""
    content = "".join(e.text for e in events if isinstance(e, Text))
    calls: dict[int, list] = {}
    for e in events:
        if isinstance(e, CallStart):
            assert e.index not in calls, "a call announced twice"
            calls[e.index] = [e.name, ""]
        elif isinstance(e, CallArgs):
            assert e.index in calls, "arguments before the name"
            calls[e.index][1] += e.text
    return content, [(name, json.loads(args)) for name, args in
                     (calls[i] for i in sorted(calls))]


def _every_chunking(parser_cls, text: str):
    """The parse of ``text``, asserted identical for whole and 1/2/3/7-character feeds."""
    whole = _assemble(_run(parser_cls(), text))
    for step in (1, 2, 3, 7):
        assert _assemble(_run(parser_cls(), text, step)) == whole, step
    return whole


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'


def test_hermes_call_with_text_around():
    text = f"Let me look that up.\n<tool_call>\n{WEATHER}\n</tool_call>\n"
    content, calls = _every_chunking(HermesParser, text)
    assert content == "Let me look that up."
    assert calls == [("get_weather", {"city": "Paris", "days": [1, 2]})]


def test_hermes_two_calls_and_text_after():
    text = (f"<tool_call>{WEATHER}</tool_call>\n<tool_call>"
            '{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call> Done.')
    content, calls = _every_chunking(HermesParser, text)
    assert calls == [("get_weather", {"city": "Paris", "days": [1, 2]}),
                     ("get_time", {"tz": "CET"})]
    assert content == "Done."


def test_hermes_malformed_json_stays_content():
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>'
    content, calls = _every_chunking(HermesParser, f"Hi {bad} and <tool_call>{WEATHER}"
                                                   "</tool_call>")
    assert content == f"Hi {bad} and"
    assert calls == [("get_weather", {"city": "Paris", "days": [1, 2]})]
    # not a call object (no name): content too
    assert _every_chunking(HermesParser, '<tool_call>{"x": 1}</tool_call>') == (
        '<tool_call>{"x": 1}</tool_call>', [])


def test_hermes_unclosed_final_call_and_string_arguments():
    # stopped at EOS before </tool_call>; arguments written as a JSON string (vLLM reads both)
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}'
    assert _every_chunking(HermesParser, text) == ("", [("f", {"a": 1})])
    # an unclosed block that is not complete JSON is content
    assert _every_chunking(HermesParser, "x <tool_call>{\"name\"") == (
        'x <tool_call>{"name"', [])


def test_hermes_holds_back_a_possible_tag_start():
    parser = HermesParser()
    assert parser.feed("Sure <tool") == [Text("Sure")]  # " <tool" may open a call
    assert parser.feed("box> is") == [Text(" <toolbox> is")]  # it did not
    assert parser.finish() == []


def test_plain_text_is_content_only():
    for cls in AUTO_PARSERS.values():
        assert _every_chunking(cls, "  Paris is sunny today.\n") == ("Paris is sunny today.", [])


@pytest.mark.parametrize("text,calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
     [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "f", "parameters": {}}', [("f", {})]),
    ('\n{"name": "f", "arguments": {"a": 1}}; {"name": "g", "parameters": {"b": [2]}}',
     [("f", {"a": 1}), ("g", {"b": [2]})]),
])
def test_llama3_json_calls(text, calls):
    assert _every_chunking(Llama3JsonParser, text) == ("", calls)


@pytest.mark.parametrize("text", [
    'I would call {"name": "f", "parameters": {}}',  # not the whole message
    '{"name": "f", "parameters": {}} and more',
    '{"name": "f", "parameters": {"a": 1}',  # cut short
    '{"parameters": {}}',  # no name
    '{"name": "f", "parameters": [1]}',  # arguments not an object
    "<|python_ta",
])
def test_llama3_json_anything_else_is_content(text):
    assert _every_chunking(Llama3JsonParser, text) == (text.strip(), [])


def test_llama3_json_streams_plain_text_at_once():
    parser = Llama3JsonParser()
    assert parser.feed("Hello") == [Text("Hello")]
    parser = Llama3JsonParser()
    assert parser.feed('{"name": "f", ') == []  # a call, maybe: held to the end


def test_required_array_streams_arguments():
    text = ('[{"name":"f","parameters":{"a":[1,{"b":"}\\"]"}],"c":true}},'
            '{"name":"g","parameters":{}}]')
    content, calls = _every_chunking(RequiredCallsParser, text)
    assert content == ""
    assert calls == [("f", {"a": [1, {"b": '}"]'}], "c": True}), ("g", {})]
    # arguments go out as they are generated, once the name is known
    parser = RequiredCallsParser()
    assert parser.feed('[{"name":"f","parameters":{"a":') == [CallStart(0, "f"),
                                                              CallArgs(0, '{"a":')]
    assert parser.feed("12") == [CallArgs(0, "12")]


def test_required_parameters_before_name_are_held():
    assert _every_chunking(RequiredCallsParser, '[{"parameters":{"x":1},"name":"g"}]') == (
        "", [("g", {"x": 1})])


def test_named_call_is_all_arguments():
    parser = NamedCallParser("f")
    assert parser.feed('{"a"') == [CallStart(0, "f"), CallArgs(0, '{"a"')]
    assert parser.feed(": 1}") == [CallArgs(0, ": 1}")]
    assert parser.finish() == []


def test_choice_deltas_and_message():
    reader = ChoiceTools(HermesParser())
    assert reader.update(f"Hi <tool_call>{WEATHER}</tool", None) == ("Hi", [], None)
    text, deltas, reason = reader.update("_call>", "stop")
    assert (text, reason) == ("", "tool_calls")
    # one delta per call and chunk: index, id, type and name, with the arguments merged in
    [delta] = deltas
    assert delta["index"] == 0 and delta["type"] == "function"
    assert delta["id"].startswith("call_") and len(delta["id"]) == 5 + 24
    assert delta["function"]["name"] == "get_weather"
    assert json.loads(delta["function"]["arguments"]) == {"city": "Paris", "days": [1, 2]}
    assert reader.content == "Hi"
    [call] = reader.tool_calls
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": [1, 2]}
    # cut by max_tokens: the reason stays "length"; no calls: stays "stop"
    assert ChoiceTools(HermesParser()).update(f"<tool_call>{WEATHER}", "length")[2] == "length"
    assert ChoiceTools(HermesParser()).update("plain", "stop")[2] == "stop"


def test_parallel_false_keeps_the_first_call():
    reader = ChoiceTools(HermesParser(), parallel=False)
    reader.update(f"<tool_call>{WEATHER}</tool_call><tool_call>{WEATHER}</tool_call>", "stop")
    assert len(reader.tool_calls) == 1
