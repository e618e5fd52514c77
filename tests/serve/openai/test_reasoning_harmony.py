"""The harmony parser (gpt-oss) on scripted token ids: analysis is reasoning, final and
commentary preambles content, headers neither; the same split whole and in chunks of
every size; a cut inside the analysis; the prompt's ending; a tool call on the
commentary channel kept in its harmony form; a tokenizer without the tokens refused;
the grammar gate frees everything before the final channel."""

from __future__ import annotations

import pytest

from llmctl.errors import UsageError
from llmctl.serve.openai.reasoning.harmony import SPECIALS, HarmonyReasoningParser, Header
from llmctl.serve.openai.reasoning.parsers import REASONING_PARSERS, reasoning_parser
from llmctl.serve.openai.reasoning.split import Phase, Split
from llmctl.serve.openai.tools.parsers import auto_parser


class Tok:
    """Greedy longest-match over characters, a few words and (``harmony``) the harmony
    special tokens, which decode to nothing when skipped."""

    def __init__(self, harmony: bool = True) -> None:
        words = ["Let", " me", " think", "analysis", "final", "commentary", "assistant",
                 " to=functions.get_time", "json", "é"]
        self.vocab = sorted({*words, *(chr(c) for c in range(32, 127)), "\n"}, key=len)
        self.special = list(SPECIALS) if harmony else []
        self.vocab += self.special
        self.ids = {t: i for i, t in enumerate(self.vocab)}

    def get_added_vocab(self) -> dict[str, int]:
        return {t: self.ids[t] for t in self.special}

    def encode(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            token = max((t for t in self.vocab if text.startswith(t, i)), key=len)
            out.append(self.ids[token])
            i += len(token)
        return out

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": self.encode(text)}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join("" if skip_special_tokens and self.vocab[i] in self.special
                       else self.vocab[i] for i in ids)


TOK = Tok()
PROMPT = "<|start|>user<|message|>What time is it?<|end|><|start|>assistant"
THINK, ANSWER = "Let me think", "It is noon."
CALL_ARGS = '{"tz": "CET"}'
OUTPUTS = {  # output -> (reasoning, content, reasoning tokens)
    f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant<|channel|>final"
    f"<|message|>{ANSWER}<|return|>": (THINK, ANSWER, 3),
    f"<|channel|>final<|message|>{ANSWER}<|return|>": ("", ANSWER, 0),
    f"<|channel|>analysis<|message|>{THINK}": (THINK, "", 3),  # cut inside the analysis
    "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>"
    "b<|end|><|start|>assistant<|channel|>final<|message|>c<|return|>": ("ab", "c", 2),
    "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final"
    "<|message|>Done<|return|>": ("", "Checking.Done", 0),
    "<|channel|>analysis<|message|>x<|channel|>final": ("x", "", 1),  # a header is cut
    "<|channel|>analysis<|message|>é é<|end|>": ("é é", "", 3),
}


def _split(output: str, chunk: int | None = None, prompt: str = PROMPT,
           tok: Tok = TOK) -> Split:
    splitter = reasoning_parser("harmony", tok).plan(tok.encode(prompt)).new_choice()
    ids = tok.encode(output)
    chunk = chunk or max(len(ids), 1)
    total = Split()
    for at in range(0, len(ids), chunk):
        part = splitter.feed("ignored text", ids[at:at + chunk])
        total.reasoning += part.reasoning
        total.content += part.content
        total.reasoning_tokens += part.reasoning_tokens
    rest = splitter.finish()
    total.reasoning += rest.reasoning
    total.content += rest.content
    return total


def test_registered_under_vllms_name():
    assert REASONING_PARSERS["harmony"] is HarmonyReasoningParser


@pytest.mark.parametrize("output", list(OUTPUTS))
def test_split_at_the_channels_whole_and_in_chunks(output):
    want = OUTPUTS[output]
    for chunk in (None, 1, 2, 3, 5):
        got = _split(output, chunk)
        assert (got.reasoning, got.content, got.reasoning_tokens) == want, chunk


def test_the_prompt_decides_where_output_starts():
    plan = reasoning_parser("harmony", TOK).plan(TOK.encode(PROMPT))
    assert plan.phase is Phase.BEFORE
    opened = PROMPT + "<|channel|>analysis<|message|>"
    assert _split(f"{THINK}<|end|>", prompt=opened).reasoning == THINK
    final = PROMPT + "<|channel|>final<|message|>"
    got = _split(ANSWER + "<|return|>", prompt=final)
    assert (got.reasoning, got.content) == ("", ANSWER)
    assert _split("final<|message|>x", prompt=PROMPT + "<|channel|>").content == "x"


def test_a_tool_call_stays_in_its_harmony_form():
    for header in ("<|channel|>commentary to=functions.get_time <|constrain|>json",
                   "<|start|>assistant to=functions.get_time<|channel|>commentary json"):
        output = (f"<|channel|>analysis<|message|>{THINK}<|end|>{header}<|message|>"
                  f"{CALL_ARGS}<|call|>")
        got = _split(output)
        assert got.reasoning == THINK
        assert got.content == ("<|channel|>commentary to=functions.get_time<|message|>"
                               f"{CALL_ARGS}<|call|>")
        assert _split(output, 1).content == got.content


def test_headers():
    assert Header.parse("assistant<|channel|>analysis") == Header("analysis", None)
    assert Header.parse("assistant to=functions.f<|channel|>commentary json") == Header(
        "commentary", "functions.f")
    assert Header.parse("<|channel|>commentary to=functions.f <|constrain|>json") == Header(
        "commentary", "functions.f")
    assert Header.parse("<|channel|>commentary").kind == "content"
    assert Header.parse("assistant").kind == "content"


def test_a_tokenizer_without_the_tokens_is_refused():
    with pytest.raises(UsageError, match="harmony"):
        reasoning_parser("harmony", Tok(harmony=False))


class Inner:
    """A grammar that records what it was shown."""

    def __init__(self) -> None:
        self.accepted: list[int] = []
        self.masks = 0

    def new_constraint(self):
        return self

    def mask(self, logits) -> None:
        self.masks += 1

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)

    def is_finished(self) -> bool:
        return False


def test_the_gate_opens_at_the_final_channel():
    import pickle

    inner = Inner()
    plan = reasoning_parser("harmony", TOK).plan(TOK.encode(PROMPT))
    gate = pickle.loads(pickle.dumps(plan.gate(inner)))  # engines get it pickled
    gate.inner = inner
    constraint = gate.new_constraint()
    head = TOK.encode(f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant"
                      "<|channel|>final<|message|>")
    for token in head:
        constraint.mask(None)
        constraint.accept(token)
    assert inner.masks == 0 and inner.accepted == []
    body = TOK.encode('{"a": 1}')
    for token in body:
        constraint.mask(None)
        constraint.accept(token)
    assert inner.masks == len(body) and inner.accepted == body
    # the prompt already in the final channel: the grammar from the first token
    final = reasoning_parser("harmony", TOK).plan(TOK.encode(PROMPT + "<|channel|>final"
                                                              "<|message|>"))
    assert final.gate(inner) is inner


def _tools(content: str, chunk: int | None = None, finish: str = "stop"):
    from llmctl.serve.openai.tools.request import ToolPlan

    reader = ToolPlan("auto", parser=auto_parser("openai")).new_choice()
    chunk = chunk or max(len(content), 1)
    pieces = [content[at:at + chunk] for at in range(0, len(content), chunk)] or [""]
    reason = None
    for k, piece in enumerate(pieces):
        _, _, reason = reader.update(piece, finish if k == len(pieces) - 1 else None)
    return reader.content, reader.tool_calls, reason


def test_the_openai_tool_parser_reads_the_calls():
    output = (f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant"
              "<|channel|>commentary<|message|>Checking.<|end|>"
              "<|start|>assistant to=functions.get_time<|channel|>commentary json"
              f"<|message|>{CALL_ARGS}<|call|>")
    content = _split(output).content
    for chunk in (None, 1, 4, 7):
        text, calls, reason = _tools(content, chunk)
        assert text == "Checking." and reason == "tool_calls"
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            ("get_time", CALL_ARGS)]
    two = content + content.replace("Checking.", "")
    assert [c["function"]["arguments"] for c in _tools(two, 3)[1]] == [CALL_ARGS] * 2


def test_the_openai_tool_parser_leaves_other_text():
    assert _tools("no calls here")[:3] == ("no calls here", None, "stop")
    browse = "<|channel|>commentary to=browser.search<|message|>{}<|call|>"
    assert _tools(browse)[:2] == (browse, None)  # not a function: content as written
    cut = "<|channel|>commentary to=functions.get_time<|message|>{\"tz\""
    text, calls, reason = _tools(cut, 5, finish="length")
    assert text == ""
    assert calls[0]["function"]["arguments"] == '{"tz"' and reason == "length"
