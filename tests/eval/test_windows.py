import numpy as np
import pytest
from pydantic import ValidationError

from llmctl.errors import ConfigError
from llmctl.eval.windows import Windowing, plan_windows, resolve_bos

IDS = list(range(100, 140))  # 40 tokens


def test_no_bos_scores_every_token_with_context():
    plan = plan_windows(IDS, Windowing(ctx=10), None)
    assert len(plan.inputs) == 4 and plan.inputs[1] == IDS[10:20]
    # rows 0..8 predict content tokens 1..9 of each window
    assert plan.rows[0].tolist() == list(range(9))
    assert plan.targets(1).tolist() == IDS[11:20]
    assert plan.scored_tokens == 36


def test_bos_is_prepended_and_first_token_scored():
    plan = plan_windows(IDS, Windowing(ctx=10), 1)
    assert plan.inputs[0] == [1] + IDS[:10]
    assert plan.rows[0].tolist() == list(range(10))
    assert plan.targets(0).tolist() == IDS[:10]
    assert plan.scored_tokens == 40


def test_stride_scores_each_token_once():
    plan = plan_windows(IDS, Windowing(ctx=10, stride=5), None)
    assert [w[0] for w in plan.inputs] == [100, 105, 110, 115, 120, 125, 130]
    scored = [t for w in range(len(plan.inputs)) for t in plan.targets(w).tolist()]
    assert scored == IDS[1:]  # every token after the first, exactly once, in order
    assert plan.rows[1].tolist() == [4, 5, 6, 7, 8]  # later windows: the 5 new tokens


def test_score_from_and_max_windows():
    plan = plan_windows(IDS, Windowing(ctx=10, score_from=5, max_windows=2), None)
    assert len(plan.inputs) == 2
    assert plan.targets(0).tolist() == IDS[5:10]


def test_tail_that_does_not_fill_a_window_is_dropped():
    plan = plan_windows(IDS[:25], Windowing(ctx=10), None)
    assert len(plan.inputs) == 2 and plan.stream_tokens == 25


def test_errors():
    with pytest.raises(ConfigError, match="fewer than one window"):
        plan_windows(IDS[:5], Windowing(ctx=10), None)
    with pytest.raises(ValidationError, match="stride"):
        Windowing(ctx=10, stride=11)
    with pytest.raises(ValidationError, match="score_from"):
        Windowing(ctx=10, score_from=10)
    with pytest.raises(ValidationError):
        Windowing(ctx=10, typo=1)


class _Tok:
    bos_token_id = 7

    def __init__(self, adds):
        self.adds = adds

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([7] if self.adds and add_special_tokens else []) + [42]}


def test_bos_auto_follows_the_tokenizer():
    assert resolve_bos(Windowing(), _Tok(adds=True)) == 7
    assert resolve_bos(Windowing(), _Tok(adds=False)) is None
    assert resolve_bos(Windowing(bos="always"), _Tok(adds=False)) == 7
    assert resolve_bos(Windowing(bos="never"), _Tok(adds=True)) is None
    assert isinstance(plan_windows(IDS, Windowing(ctx=10), None).rows[0], np.ndarray)
