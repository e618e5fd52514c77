"""Trace replay (llmctl.bench.trace, ``--dataset trace``): Mooncake-format lines read and
refused line by line, prompts whose shared hash ids are shared text, and requests sent on
the trace's clock through the CLI against the fake server."""

from __future__ import annotations

import json

import pytest

from llmctl.bench import trace
from llmctl.bench.datasets import DatasetSpec, build_dataset
from llmctl.bench.records import SampleRequest
from llmctl.bench.runner import RunPlan, schedule
from llmctl.errors import ConfigError, UsageError
from tests.bench.test_cli import bench, only_report

ROWS = [  # two requests sharing two blocks, then one of its own; out of time order
    {"timestamp": 500, "input_length": 20, "output_length": 3, "hash_ids": [1, 2, 3]},
    {"timestamp": 0, "input_length": 16, "output_length": 3, "hash_ids": [1, 2]},
    {"timestamp": 1500, "input_length": 5, "output_length": 2, "hash_ids": [4]},
]


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("line, message", [
    ('{"timestamp": 1, "input_length": 3}', r"t\.jsonl:2: no output_length"),
    ("not json", r"t\.jsonl:2: not JSON"),
    ('{"timestamp": 1, "input_length": "x", "output_length": 1}', "must be numbers"),
    ('{"timestamp": -1, "input_length": 3, "output_length": 1}', "the timestamp >= 0"),
    ("[1, 2]", r"t\.jsonl:2: not an object"),
])
def test_a_bad_line_is_one_error_naming_it(tmp_path, line, message):
    path = _write(tmp_path / "t.jsonl", [ROWS[0], line])
    with pytest.raises(ConfigError, match=message) as caught:
        trace.read_trace(path)
    assert "\n" not in caught.value.args[0]
    with pytest.raises(UsageError, match="no trace at"):
        trace.read_trace(tmp_path / "missing.jsonl")


def test_arrivals_follow_the_trace_clock_scaled():
    requests = [trace.TraceRequest(t, 1, 1) for t in (1000.0, 1500.0, 3000.0)]
    assert trace.arrivals(requests) == [0.0, 0.5, 2.0]
    assert trace.arrivals(requests, time_scale=2.0) == [0.0, 0.25, 1.0]


def test_shared_hash_ids_are_shared_prompt_text(tiny_llama, tmp_path):
    """Blocks of 8 tokens: the 16-token request is blocks 1 and 2, the 20-token one blocks
    1, 2 and 4 tokens of block 3, so its prompt starts with the other's whole prompt; the
    third shares nothing. A trace listing fewer ids than its length needs gets blocks of
    its own."""
    from llmctl.models.loading import load_tokenizer

    tok = load_tokenizer(tiny_llama)
    spec = DatasetSpec(name="trace", path=str(_write(tmp_path / "t.jsonl", ROWS)),
                       trace_block_tokens=8, trace_time_scale=2.0)
    long, short, other = build_dataset(spec, tok)
    assert long.prompt.startswith(short.prompt) and len(long.prompt) > len(short.prompt)
    assert not other.prompt.startswith(short.prompt[:10])
    assert [s.arrival for s in (long, short, other)] == [0.25, 0.0, 0.75]
    assert [s.output_len for s in (long, short, other)] == [3, 3, 2]
    for sample, row in zip((long, short, other), ROWS, strict=True):
        assert abs(sample.prompt_len - row["input_length"]) <= 2  # BPE merges at block joins
    assert build_dataset(spec, tok) == [long, short, other]  # the same seed, the same text
    spec_short = spec.model_copy(update={"num_prompts": 1})
    assert len(build_dataset(spec_short, tok)) == 1
    keys = trace.block_ids(trace.TraceRequest(0, 20, 1, (7,)), index=3, block_tokens=8)
    assert keys == [(7,), (-1, 3, 1), (-1, 3, 2)]


def test_the_schedule_sends_on_the_samples_own_arrivals():
    samples = [SampleRequest("a", 1, 1, arrival=0.5), SampleRequest("b", 1, 1, arrival=0.0),
               SampleRequest("c", 1, 1, arrival=2.0)]
    got = [(i, t) for i, _, t in schedule(RunPlan(samples, request_rate=3.0))]
    assert got == [(1, 0.0), (0, 0.5), (2, 2.0)]


def test_replayed_through_the_cli_on_the_trace_clock(server, tiny_llama, tmp_path):
    path = _write(tmp_path / "t.jsonl", ROWS)
    result = bench("--target", server, "--model", tiny_llama, "--dataset", "trace",
                   "--dataset-path", path, "--trace-block-tokens", 8,
                   "--trace-time-scale", 2, "--result-dir", tmp_path / "out", "--no-plots")
    assert result.exit_code == 0, result.output
    report = only_report(tmp_path / "out")
    assert report["completed"] == 3 and report["dataset"]["name"] == "trace"
    assert sorted(report["scheduled_times"]) == pytest.approx([0.0, 0.25, 0.75])
    assert report["duration"] >= 0.75


@pytest.mark.parametrize("extra, clash", [
    (["--request-rate", "5"], "--request-rate"), (["--duration", "3"], "--duration"),
])
def test_flags_that_set_arrivals_are_refused_with_a_trace(tmp_path, extra, clash):
    path = _write(tmp_path / "t.jsonl", ROWS)
    result = bench("--target", "http://127.0.0.1:9", "--dataset", "trace", "--dataset-path",
                   path, *extra)
    assert result.exit_code == 2
    assert f"replays the trace's own arrivals: drop {clash}" in result.output
