"""Multi-turn conversations (llmctl.bench.conversations, ``--dataset multi-turn``): each
turn carries the history with the answers the server gave, later turns follow their answer
after the think time, a failed turn ends its conversation, and the report gives TTFT per
turn."""

from __future__ import annotations

import pytest

from llmctl.bench.conversations import Conversation, chat_messages, ttft_by_turn
from llmctl.bench.records import RequestRecord, SampleRequest
from tests.bench.test_cli import bench, only_report


def _conversation(think: float = 0.0) -> Conversation:
    return Conversation((SampleRequest("hi", 2, 5), SampleRequest("and?", 3, 6),
                         SampleRequest("bye", 2, 7)), think)


def test_each_turn_carries_the_history_with_the_answers_given():
    conv = _conversation()
    first = conv.first()
    assert (first.turn, first.history, first.conversation) == (0, (), conv)
    answered = RequestRecord(0, 2, 5, ttft=0.1, output_tokens=4, text="hello there",
                             prompt_tokens_server=9)
    second = conv.follow_up(first, answered)
    assert second.turn == 1 and second.history == (("hi", "hello there"),)
    assert second.prompt == "and?" and second.output_len == 6
    assert second.prompt_len == 9 + 4 + 3  # as the server counted the history, + answer, + new
    third = conv.follow_up(second, RequestRecord(1, 16, 6, output_tokens=2, text="so"))
    assert chat_messages(third) == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "and?"}, {"role": "assistant", "content": "so"},
        {"role": "user", "content": "bye"}]
    assert conv.follow_up(third, RequestRecord(2, 1, 1, text="x")) is None  # the last turn
    failed = RequestRecord(0, 2, 5, error="HTTP 500", error_kind="http")
    assert conv.follow_up(first, failed) is None  # a failed turn ends the conversation


def test_ttft_by_turn_by_hand():
    records = [RequestRecord(i, 1, 1, ttft=t, turn=turn)
               for i, (t, turn) in enumerate([(0.010, 0), (0.030, 0), (0.020, 1), (0.5, None)])]
    records.append(RequestRecord(9, 1, 1, ttft=0.9, turn=1, error="x"))  # failed: left out
    got = ttft_by_turn(records)
    assert set(got) == {"1", "2"}
    assert got["1"]["n"] == 2 and got["1"]["mean_ms"] == pytest.approx(20.0)
    assert got["2"] == pytest.approx({"n": 1, "mean_ms": 20.0, "median_ms": 20.0,
                                      "p90_ms": 20.0})


def test_conversations_run_turn_by_turn_through_the_cli(server, tiny_llama, tmp_path):
    """2 conversations x 3 turns, 0.2 s of thinking between turns: six requests, three
    turns each answered twice, the run at least two think times long."""
    result = bench("--target", server, "--model", tiny_llama, "--dataset", "multi-turn",
                   "--backend", "openai-chat", "-n", 2, "--turns", 3, "--input-len", 8,
                   "--output-len", 4, "--think-time", 0.2, "--result-dir", tmp_path,
                   "--no-plots")
    assert result.exit_code == 0, result.output
    report = only_report(tmp_path)
    assert report["completed"] == 6 and report["num_requests"] == 6
    assert {k: v["n"] for k, v in report["ttft_by_turn"].items()} == {"1": 2, "2": 2, "3": 2}
    assert report["duration"] >= 0.4
    assert report["dataset"]["turns"] == 3 and report["num_prompts"] == 2


@pytest.mark.parametrize("extra", [["--backend", "openai-completions"],
                                   ["--backend", "openai-chat", "--duration", "2"]])
def test_multi_turn_needs_chat_and_a_counted_run(extra):
    result = bench("--target", "http://127.0.0.1:9", "--dataset", "multi-turn",
                   "--input-len", 8, *extra)
    assert result.exit_code == 2
    assert "--dataset multi-turn sends chat histories" in result.output
