"""The reasoning parsers on scripted outputs: the split falls exactly at the tags for
each parser, whole and in chunks of every size (tags cut across chunks included), by
token id where the tags are single tokens and by text where not; no tags and
unterminated thinking; the prompt's ending decides where output starts."""

from __future__ import annotations

import pytest

from llmctl.serve.openai.reasoning.parsers import (
    THINK_TAG_PARSERS,
    ReasoningPlan,
    reasoning_parser,
)
from llmctl.serve.openai.reasoning.split import Phase, Split, ThinkingSplitter, split_whole


class Tok:
    """Greedy longest-match over a small vocabulary: characters, some words and, with
    ``tags``, ``<think>``/``</think>`` as single tokens (else they take several)."""

    def __init__(self, tags: bool) -> None:
        words = ["Let", " me", " think", "think", "</", "<", ">", "answer", "\n\n"]
        self.vocab = sorted({*words, *(chr(c) for c in range(32, 127)), "\n"}, key=len)
        if tags:
            self.vocab += ["<think>", "</think>"]
        self.ids = {t: i for i, t in enumerate(self.vocab)}

    def encode(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            token = max((t for t in self.vocab if text.startswith(t, i)), key=len)
            out.append(self.ids[token])
            i += len(token)
        return out

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": self.encode(text)}

    def decode(self, ids) -> str:
        return "".join(self.vocab[i] for i in ids)


OUTPUTS = {  # scripted output -> (deepseek_r1 split, qwen3 split)
    "<think>Let me think</think>answer": (("Let me think", "answer"),
                                          ("Let me think", "answer")),
    "Let me think</think>\n\nanswer": (("Let me think", "\n\nanswer"),
                                       ("", "Let me think\n\nanswer")),
    "answer": (("answer", ""), ("", "answer")),
    "<think>Let me th": (("Let me th", ""), ("Let me th", "")),
    "Let me th": (("Let me th", ""), ("", "Let me th")),
    "<think></think>answer <think>x</think>": (("", "answer <think>x</think>"),
                                               ("", "answer <think>x</think>")),
    "a < b <th</thinkish>": (("a < b <th</thinkish>", ""), ("", "a < b <th</thinkish>")),
}


def _plan(name: str, tok: Tok, prompt: str = "user: hi\nassistant:") -> ReasoningPlan:
    return reasoning_parser(name, tok).plan(tok.encode(prompt))


def _chunked(splitter: ThinkingSplitter, tok: Tok, text: str, size: int) -> Split:
    """Fed ``size`` tokens at a time (text decoded per chunk, as the detokenizer gives)."""
    ids, total = tok.encode(text), Split()
    for piece in [ids[i:i + size] for i in range(0, len(ids), size)] + [None]:
        out = splitter.finish() if piece is None else splitter.feed(tok.decode(piece), piece)
        total.reasoning += out.reasoning
        total.content += out.content
        total.reasoning_tokens += out.reasoning_tokens
    return total


@pytest.mark.parametrize("tags", [True, False], ids=["by-id", "by-text"])
@pytest.mark.parametrize("name", list(THINK_TAG_PARSERS))
@pytest.mark.parametrize("text", list(OUTPUTS))
def test_split_whole_and_chunked(text, name, tags):
    tok = Tok(tags)
    plan = _plan(name, tok)
    assert plan.parser.tags.by_id is tags
    want = OUTPUTS[text][list(THINK_TAG_PARSERS).index(name)]
    ids = tok.encode(text)
    assert split_whole(plan.new_choice(), text, ids) == want
    for size in range(1, len(ids) + 1):
        got = _chunked(plan.new_choice(), tok, text, size)
        assert (got.reasoning, got.content) == want, size


def test_text_split_holds_a_tag_cut_across_chunks():
    tok = Tok(tags=False)
    splitter = _plan("qwen3", tok).new_choice()
    pieces = ["<th", "ink>Let", " me</", "thi", "nk", ">answer"]
    outs = [splitter.feed(p, tok.encode(p)) for p in pieces] + [splitter.finish()]
    assert [(o.reasoning, o.content) for o in outs] == [
        ("", ""), ("Let", ""), (" me", ""), ("", ""), ("", ""), ("", "answer"), ("", "")]


def test_reasoning_tokens_by_id_exclude_the_tags():
    tok = Tok(tags=True)
    text = "<think>Let me think</think>answer"
    for name in THINK_TAG_PARSERS:
        for size in (1, 2, 5):
            got = _chunked(_plan(name, tok).new_choice(), tok, text, size)
            assert got.reasoning_tokens == len(tok.encode("Let me think")), (name, size)


def test_reasoning_tokens_by_text_one_token_at_a_time():
    tok = Tok(tags=False)
    text = "Let me think</think>answer"
    got = _chunked(_plan("deepseek_r1", tok).new_choice(), tok, text, 1)
    assert got.reasoning_tokens == len(tok.encode("Let me think"))


def test_a_skipped_tag_still_splits_by_id():
    # a special tag token the detokenizer skipped: no tag text, the token still switches
    tok = Tok(tags=True)
    splitter = _plan("deepseek_r1", tok).new_choice()
    ids = tok.encode("Let me think</think>answer")
    out = splitter.feed("Let me thinkanswer", ids)
    assert (out.reasoning, out.content) == ("Let me think", "answer")


def test_by_id_the_tag_text_written_in_pieces_is_not_a_tag():
    tok = Tok(tags=True)
    splitter = _plan("deepseek_r1", tok).new_choice()
    ids = [tok.ids[c] for c in "a</think>b"]  # the characters, not the tag token
    assert split_whole(splitter, "a</think>b", ids) == ("a</think>b", "")


@pytest.mark.parametrize("name", list(THINK_TAG_PARSERS))
def test_the_prompt_ending_decides_the_first_phase(name):
    tok = Tok(tags=True)
    assert _plan(name, tok, "assistant:\n<think>\n").phase is Phase.THINKING
    closed = _plan(name, tok, "assistant:\n<think>\n\n</think>\n\n")
    assert closed.phase is Phase.ANSWER
    assert split_whole(closed.new_choice(), "answer", tok.encode("answer")) == ("", "answer")
    default = THINK_TAG_PARSERS[name].default_phase
    assert _plan(name, tok).phase is default


def test_unknown_parser_lists_the_names():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        reasoning_parser("nope", Tok(tags=True))
    assert reasoning_parser(None, Tok(tags=True)) is None


def test_gate_needs_single_token_tags_unless_the_answer_starts_at_once():
    grammar = object()
    with pytest.raises(ValueError, match="no single token"):
        _plan("deepseek_r1", Tok(tags=False)).gate(grammar)
    closed = _plan("qwen3", Tok(tags=False), "a:<think></think>")
    assert closed.gate(grammar) is grammar
