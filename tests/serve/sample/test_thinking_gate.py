"""ThinkingGate: the answer's constraint masks nothing while the sequence thinks, takes
over after the end-of-thinking token, and before any thinking lets the start token
through beside the grammar's own tokens."""

import pickle

import torch

from llmctl.serve.sample.thinking_gate import ThinkingGate

START, END, VOCAB = 5, 6, 8


class OnlyToken:
    """A stand-in grammar: token 1, then finished; records what it was fed."""

    def __init__(self) -> None:
        self.fed: list[int] = []

    def new_constraint(self):
        return self

    def mask(self, logits: torch.Tensor) -> None:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[1] = True
        logits.masked_fill_(~keep, float("-inf"))

    def accept(self, token_id: int) -> None:
        self.fed.append(token_id)

    def is_finished(self) -> bool:
        return bool(self.fed)


def _allowed(constraint) -> list[int]:
    row = torch.zeros(VOCAB)
    constraint.mask(row)
    return [i for i in range(VOCAB) if row[i].isfinite()]


def test_thinking_is_unmasked_and_the_answer_is_the_grammars():
    inner = OnlyToken()
    gated = ThinkingGate(inner, START, END, thinking=True).new_constraint()
    for token in (3, 4, START, 2):
        assert _allowed(gated) == list(range(VOCAB))
        gated.accept(token)
        assert not gated.is_finished()
    gated.accept(END)
    assert _allowed(gated) == [1] and inner.fed == []
    gated.accept(1)
    assert inner.fed == [1] and gated.is_finished()


def test_before_thinking_the_start_token_or_the_grammar():
    inner = OnlyToken()
    opens = ThinkingGate(inner, START, END, thinking=False).new_constraint()
    assert _allowed(opens) == [1, START]
    opens.accept(START)
    assert _allowed(opens) == list(range(VOCAB))
    answers = ThinkingGate(OnlyToken(), START, END, thinking=False).new_constraint()
    answers.accept(1)  # no thinking: the grammar had the first token
    assert answers.inner.fed == [1] and answers.is_finished()
    assert _allowed(answers) == [1]


def test_pickles_for_engine_processes():
    gate = ThinkingGate(OnlyToken(), START, END, thinking=True)
    back = pickle.loads(pickle.dumps(gate))
    assert (back.start_id, back.end_id, back.thinking) == (START, END, True)
