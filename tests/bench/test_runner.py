"""One measured run against the fake server: cap, warm-up, duration, dead target, Ctrl-C."""

import asyncio
import itertools

import pytest

from llmctl.bench.backends import RequestSettings, get_backend
from llmctl.bench.metrics import compute_metrics
from llmctl.bench.records import SampleRequest
from llmctl.bench.runner import Halt, RunPlan, fill_output_tokens, run, schedule

from .conftest import fake_server

SAMPLES = [SampleRequest(f"prompt {i}", 2, 4) for i in range(12)]


def go(url, plan, backend="openai-completions", halt_after=None):
    async def main():
        halt = Halt()
        if halt_after is not None:
            asyncio.get_running_loop().call_later(halt_after, halt.interrupt)
        return await run(plan, get_backend(backend), RequestSettings(url, "fake-model"),
                         halt=halt)
    return asyncio.run(main())


def test_concurrency_cap_warmup_and_server_counters(server):
    result = go(server, RunPlan(SAMPLES, max_concurrency=3, warmup=2))
    assert [r.index for r in result.records] == list(range(12))  # warm-up not recorded
    assert all(r.success for r in result.records) and result.warmup_failed == 0
    m = compute_metrics(result.records, result.duration)
    assert m["peak_concurrency"] == 3
    # /metrics is scraped after the warm-up: its counters match what was measured.
    summary = result.server_summary
    assert summary["available"]
    assert summary["generation_tokens"] == m["total_output_tokens"] == 12 * 4
    assert summary["prompt_tokens"] == m["total_input_tokens"] == 12 * 2


class FakeClock:
    """The runner's ``time``: advances only when the runner waits for a send time, so how
    many requests fit in the duration does not depend on the machine's load."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    async def wait(self, halt, seconds: float) -> None:
        self.now += max(seconds, 0.0)


def test_duration_limit_cycles_the_samples(server, monkeypatch):
    from llmctl.bench import runner

    clock = FakeClock()
    monkeypatch.setattr(runner, "time", clock)
    monkeypatch.setattr(runner, "_wait", clock.wait)
    plan = RunPlan(SAMPLES[:3], request_rate=40.0, duration=0.5, seed=1)
    within = [(i, t) for i, _, t in itertools.takewhile(lambda x: x[2] <= 0.5, schedule(plan))]
    assert len(within) > 3  # the 3 samples are cycled
    result = go(server, plan)
    # exactly the requests scheduled inside the duration, none after it
    assert [(r.index, r.scheduled) for r in result.records] == within
    assert all(r.success for r in result.records)
    assert {r.prompt_len for r in result.records} == {2}


def test_target_dies_mid_run_records_the_rest_as_failed():
    with fake_server("--ttft-ms", "5", "--itl-ms", "5", "--die-after", "5") as (url, _):
        result = go(url, RunPlan(SAMPLES + SAMPLES, max_concurrency=2))
    records = result.records
    assert len(records) == 24 == sum(r.success for r in records) + sum(not r.success
                                                                      for r in records)
    assert result.target_down is not None and not result.interrupted
    # The server dies on its 5th request: at most 4 can succeed (how many of them finish
    # first depends on scheduling), and everything after the crash is a failure record.
    assert 1 <= sum(r.success for r in records) <= 4
    assert result.not_sent == sum(r.error_kind == "not_sent" for r in records) >= 1
    assert sorted(r.index for r in records) == list(range(24))


def test_interrupt_returns_a_partial_run(server):
    # No initial probe: on a loaded machine it can outlast the 0.6 s before the interrupt.
    plan = RunPlan([SampleRequest("p", 2, 50)] * 40, request_rate=10.0, initial_check=False)
    result = go(server, plan, halt_after=0.6)
    # On a loaded machine the interrupt can land before the first request is sent.
    assert result.interrupted and len(result.records) < 40
    assert all(r.success or "interrupted" in r.error for r in result.records)
    assert result.not_sent == 0


def test_output_tokens_fallbacks():
    from llmctl.bench.records import RequestRecord

    usage = RequestRecord(0, 1, 4, ttft=0.1, output_tokens=4, text="a b")
    text = RequestRecord(1, 1, 4, ttft=0.1, itl=[0.1], text="a b c")
    chunks = RequestRecord(2, 1, 4, ttft=0.1, itl=[0.1, 0.1], text="abc")
    fill_output_tokens([usage, text], lambda s: len(s.split()))
    fill_output_tokens([chunks], None)
    assert (usage.output_tokens, text.output_tokens, chunks.output_tokens) == (4, 3, 3)
    assert text.output_tokens_source == "tokenizer" and chunks.output_tokens_source == "chunks"


@pytest.mark.parametrize("backend", ["openai-chat"])
def test_chat_run(server, backend):
    result = go(server, RunPlan(SAMPLES[:4]), backend=backend)
    assert all(r.success and r.output_tokens == 4 for r in result.records)
