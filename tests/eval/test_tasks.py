"""Built-in multiple-choice tasks, our scorer against lm-evaluation-harness itself."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from llmctl.errors import ConfigError
from llmctl.eval.candidates import open_candidate
from llmctl.eval.tasks import (
    builtin_task_names,
    encode_pair,
    expand_task_names,
    lm_eval_task_yaml,
    load_task,
    score_task,
)

LIMIT = 8


def test_builtin_sets_are_well_formed():
    assert builtin_task_names() == ["everyday-mc", "python-mc", "science-mc"]
    for name in builtin_task_names():
        task = load_task(name)
        assert len(task.items) == 50
        assert len({i.id for i in task.items}) == 50
        for item in task.items:
            assert len(set(item.choices)) == len(item.choices) == 4
        golds = Counter(i.gold for i in task.items)
        assert len(golds) == 4 and max(golds.values()) <= 20  # answers not all in one slot


def test_task_names_and_errors(tmp_path):
    assert expand_task_names(["builtin"]) == builtin_task_names()
    assert expand_task_names(["python-mc,lm_eval:x", "python-mc"]) == ["python-mc", "lm_eval:x"]
    with pytest.raises(ConfigError, match="unknown task") as err:
        load_task("nope")
    assert "python-mc" in err.value.remedy
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"query": "q", "choices": ["a", "b"], "gold": 2}) + "\n")
    with pytest.raises(ConfigError, match="gold 2"):
        load_task(str(bad))
    bad.write_text('{"query": "q"}\n')
    with pytest.raises(ConfigError, match="not a task item"):
        load_task(str(bad))


class _Tok:
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def test_encode_pair_moves_trailing_spaces_to_the_continuation():
    ctx, cont = encode_pair(_Tok(), "Answer: ", "yes")
    assert ctx == [ord(c) for c in "Answer:"] and cont == [ord(c) for c in " yes"]


@pytest.fixture(scope="module")
def lm_eval_dir(tmp_path_factory):
    pytest.importorskip("lm_eval")
    directory = tmp_path_factory.mktemp("lm-eval-tasks")
    (directory / "python_mc.yaml").write_text(lm_eval_task_yaml(load_task("python-mc")))
    return directory


def test_scores_equal_lm_evaluation_harness_hf_backend(tiny_llama, lm_eval_dir, monkeypatch):
    """lm-eval's own HF model class on the same items: same log-likelihoods, same accuracy."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    theirs = evaluator.simple_evaluate(
        model="hf", model_args=f"pretrained={tiny_llama},dtype=float32", device="cpu",
        tasks=["python_mc"], task_manager=TaskManager(include_path=str(lm_eval_dir), include_defaults=False),
        limit=LIMIT, log_samples=True, bootstrap_iters=0)
    ours = score_task(open_candidate(str(tiny_llama)), load_task("python-mc"), LIMIT)
    samples = sorted(theirs["samples"]["python_mc"], key=lambda s: s["doc_id"])
    for sample, item in zip(samples, ours.details["items"]):
        their_lls = [resp[0][0] for resp in sample["resps"]]  # [(loglikelihood, is_greedy)]
        assert item["loglikelihoods"] == pytest.approx(their_lls, rel=1e-4, abs=1e-4)
    assert ours.acc == theirs["results"]["python_mc"]["acc,none"]
    assert ours.acc_norm == theirs["results"]["python_mc"]["acc_norm,none"]


def test_lm_eval_tasks_run_on_llmctl_candidates(tiny_llama, lm_eval_dir):
    from llmctl.eval.lm_eval_bridge import run_lm_eval

    candidate = open_candidate(str(tiny_llama))
    (result,) = run_lm_eval(candidate, ["python_mc"], lm_eval_dir, limit=LIMIT, seed=0)
    ours = score_task(candidate, load_task("python-mc"), LIMIT)
    assert (result.n, result.acc, result.acc_norm) == (LIMIT, ours.acc, ours.acc_norm)
