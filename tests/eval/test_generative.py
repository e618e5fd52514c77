"""Generative eval tasks (llmctl.eval.generative): answers scored by number or text after
the reasoning is taken out, whether a server's reasoning parser split it or the text still
holds the think tags; answers that never left the thinking counted and scored 0; thinking
switched off through the template. Through a real llmctl server (a scripted sampler on a
tiny model whose template thinks, as tests/serve/api/test_reasoning_http.py builds it) and
through the local candidates, whose greedy answers must agree."""

from __future__ import annotations

import json

import pytest

from llmctl.errors import ConfigError
from llmctl.eval.candidates import CandidateOptions, open_candidate
from llmctl.eval.generative import Generation, GenItem, is_correct, prediction, split_reasoning
from llmctl.eval.tasks import GenTask, load_task, score_task
from tests.serve.api.test_reasoning_http import _start, scripted, thinking_model  # noqa: F401


@pytest.mark.parametrize("generation, answer, had, ended", [
    (Generation("The answer is 4.", "Let me think", "stop"), "The answer is 4.", True, False),
    (Generation("", "Let me think about", "length"), "", True, True),
    (Generation("<think>hmm</think>\n\n4", None, "stop"), "\n\n4", True, False),
    (Generation("hmm, 3? no</think> 4", None, "stop"), " 4", True, False),  # template opened it
    (Generation("<think>3 or 5", None, "length"), "", True, True),
    (Generation("It is 4.", None, "stop"), "It is 4.", False, False),
])
def test_reasoning_is_split_off_before_scoring(generation, answer, had, ended):
    assert split_reasoning(generation) == (answer, had, ended)


@pytest.mark.parametrize("answer, item, ok", [
    ("The answer is 1,250.", GenItem("a", "", "1250", "number"), True),
    ("7 + 5 = 12", GenItem("a", "", "12", "number"), True),  # the last number
    ("12 or maybe 13", GenItem("a", "", "12", "number"), False),
    ("-3.50", GenItem("a", "", "-3.5", "number"), True),
    ("no idea", GenItem("a", "", "4", "number"), False),
    ("  Paris. ", GenItem("a", "", "paris", "exact"), True),
    ("Paris, France", GenItem("a", "", "Paris", "exact"), False),
])
def test_answers_match_by_number_or_text(answer, item, ok):
    assert is_correct(answer, item) is ok
    assert prediction("", "number") is None


def test_the_builtin_generative_set_and_bad_files(tmp_path):
    task = load_task("arith-gen")
    assert isinstance(task, GenTask) and len(task.items) == 40
    assert all(i.match == "number" and i.answer.lstrip("-").isdigit() for i in task.items)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "answer": "1", "match": "fuzzy"}) + "\n")
    with pytest.raises(ConfigError, match="match 'fuzzy' is not one of number, exact"):
        load_task(str(bad))
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ConfigError, match="is not a generative task item"):
        load_task(str(bad))


def _task(tmp_path) -> GenTask:
    path = tmp_path / "two-plus-two.jsonl"
    path.write_text("\n".join(json.dumps(i) for i in [
        {"id": "right", "prompt": "What is 2 + 2?", "answer": "4", "match": "number"},
        {"id": "wrong", "prompt": "What is 2 + 3?", "answer": "5", "match": "number"}]) + "\n")
    task = load_task(str(path))
    assert isinstance(task, GenTask)
    return task


@pytest.fixture(scope="module")
def servers(thinking_model):  # noqa: F811 (the imported fixture)
    """The same model served with the qwen3 reasoning parser and without one."""
    parsed, plain = _start(thinking_model, reasoning_parser="qwen3"), _start(thinking_model)
    yield parsed, plain
    parsed.stop()
    plain.stop()


def _score(running, task, **kwargs):
    candidate = open_candidate(running.url, CandidateOptions(
        tokenizer=running.engine.engine.tokenizer))
    return score_task(candidate, task, **kwargs).report_entry()


def test_through_a_server_reasoning_is_stripped_split_or_not(servers, tmp_path):
    """The scripted model thinks "Let me think", then answers "The answer is 4." to both
    items: one right, one wrong, with the parser's split or the tags in the text alike."""
    task = _task(tmp_path)
    for running in servers:
        with scripted(running, "<think>Let me think</think>", "The answer is 4."):
            report = _score(running, task)
        assert (report["acc"], report["n"]) == (0.5, 2)
        assert report["reasoning_stripped"] == 2 and report["ended_in_thinking"] == 0
        assert [i["pred"] for i in report["items"]] == ["4", "4"]
        assert report["items"][0]["answer"] == "The answer is 4."


def test_a_budget_spent_thinking_scores_zero_and_is_counted(servers, tmp_path):
    task = _task(tmp_path)
    for running in servers:
        with scripted(running, "<think>Let me think about 4 and 4 and 4</think>", "4"):
            report = _score(running, task, max_tokens=4)
        assert report["acc"] == 0.0 and report["ended_in_thinking"] == 2, report["items"]
        assert {i["finish_reason"] for i in report["items"]} == {"length"}


def test_thinking_switched_off_through_the_template(servers, tmp_path):
    """``thinking=False`` sends enable_thinking false: the template closes the thinking,
    the scripted model answers at once, nothing is stripped."""
    parsed, _ = servers
    with scripted(parsed, "<think>Let me think</think>", "4"):
        report = _score(parsed, _task(tmp_path), thinking=False)
    assert report["acc"] == 0.5 and report["reasoning_stripped"] == 0
    assert report["thinking"] is False


def test_local_candidates_answer_as_the_engine_does(thinking_model, tmp_path):  # noqa: F811
    """transformers' greedy answer and the serving engine's (float32) through the same
    chat template: the same text, so the same scores."""
    task = _task(tmp_path)
    hf = open_candidate(str(thinking_model), CandidateOptions(backend="transformers"))
    serve = open_candidate(str(thinking_model), CandidateOptions(backend="serve"))
    a = score_task(hf, task, max_tokens=12).report_entry()
    b = score_task(serve, task, max_tokens=12).report_entry()
    assert [i["answer"] for i in a["items"]] == [i["answer"] for i in b["items"]]
    assert [i["finish_reason"] for i in a["items"]] == [i["finish_reason"] for i in b["items"]]
    assert a["items"][0]["answer"]  # the tiny model wrote something


def test_candidates_that_cannot_generate_say_so(tmp_path):
    from llmctl.eval.candidates import Candidate

    class Scores(Candidate):  # a scoring-only adapter (as the llama.cpp and engine ones)
        kind = "scores"
        tokenizer = vocab_size = None

        def describe(self):
            return {}

    with pytest.raises(ConfigError, match="a scores candidate cannot generate answers"):
        score_task(Scores("x", CandidateOptions()), _task(tmp_path))


def test_the_cli_runs_a_generative_task_against_a_server(servers, thinking_model,  # noqa: F811
                                                        tmp_path):
    """``llmctl eval URL --tasks FILE --no-thinking``: the report's task block; a zero
    token budget is a usage error."""
    from tests.cli.test_usage_errors import assert_usage_error, run

    parsed, _ = servers
    path = tmp_path / "two-plus-two.jsonl"
    _task(tmp_path)
    with scripted(parsed, "<think>Let me think</think>", "4"):
        result = run("eval", parsed.url, "--data", "none", "--tokenizer", thinking_model, "--tasks",
                     path, "--no-thinking", "--json", "-o", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    block = json.loads((tmp_path / "r.json").read_text())["tasks"]["two-plus-two"]
    assert (block["acc"], block["thinking"], block["kind"]) == (0.5, False, "generative")
    assert_usage_error(run("eval", parsed.url, "--task-max-tokens", "0"), "--task-max-tokens")
