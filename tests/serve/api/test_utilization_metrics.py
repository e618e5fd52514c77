"""The engine meters every step's FLOPs, bytes and seconds by phase (llmctl.perf.meter),
and /metrics exports them as counters plus MFU/MBU gauges against the hardware's peaks."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from llmctl.perf.costs import ArchSpec, ModelCost
from llmctl.perf.peaks import Peaks
from llmctl.serve.api.metrics import ServerMetrics
from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.llm import LLM
from llmctl.serve.engine.stats import EngineStats
from tests.serve.api.test_load import _metric


def test_the_engine_counts_each_token_in_its_phase_with_the_cost_models_formulas(tiny_llama):
    """Two prompts prefilled in one step, then max_tokens - 1 decode steps of both: the
    meter's totals are the cost model's sums over exactly those tokens and contexts."""
    llm = LLM(str(tiny_llama), kv_cache_memory="32MiB", enable_prefix_caching=False)
    prompts, new = [[5, 17, 33, 99, 4], [8, 9, 10]], 6
    llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    engine = llm.engine
    cost = ModelCost(ArchSpec.from_config(json.loads((tiny_llama / "config.json").read_text())),
                     kv_bytes=engine.target.kv_cache.element_size())
    weights = engine.target.model.bytes_read_per_step
    totals = engine.stats().perf_totals
    pre, dec = totals["prefill"], totals["decode"]
    assert pre.flops == pytest.approx(sum(cost.prefill_flops(len(p)) for p in prompts))
    assert pre.bytes == pytest.approx(weights + cost.kv_bytes_per_token * sum(map(len, prompts)))
    contexts = [len(p) + j for p in prompts for j in range(1, new)]
    assert dec.flops == pytest.approx(cost.decode_step_flops(contexts))
    assert dec.bytes == pytest.approx((new - 1) * weights
                                      + cost.kv_bytes_per_token * sum(contexts))
    assert 0 < pre.seconds and 0 < dec.seconds
    # the tied head's table is read by the head; nothing else is left out
    model = engine.target.model
    assert weights <= model.nbytes


def test_metrics_render_the_counters_and_gauges_with_the_peak_source(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_memory="32MiB")
    llm.generate([[5, 17, 33]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    stats = llm.engine.stats()
    peaks = Peaks({"fp32": 1e9}, 1e9, "test peaks")
    text = ServerMetrics("tiny", lambda: stats, peaks).render().decode()
    totals = stats.perf_totals
    assert _metric(text, "llmctl:decode_flops_total") == pytest.approx(totals["decode"].flops)
    assert _metric(text, "llmctl:prefill_busy_seconds_total") == pytest.approx(
        totals["prefill"].seconds)
    recent = stats.perf_recent["decode"]
    assert stats.perf_dtype == "fp32"  # the tiny model loads in float32
    line = next(x for x in text.splitlines() if x.startswith("llmctl:mbu{")
                and 'phase="decode"' in x)
    assert 'peak_source="test peaks"' in line
    assert float(line.rsplit(" ", 1)[1]) == pytest.approx(recent.bytes / recent.seconds / 1e9)
    # unknown hardware: the counters stay, the gauges go (never a guessed peak)
    text = ServerMetrics("tiny", lambda: stats, None).render().decode()
    assert "llmctl:decode_flops_total" in text and "llmctl:mfu{" not in text


def test_the_server_exports_the_counters(served):
    before = httpx.get(served.url + "/metrics").text
    resp = httpx.post(served.url + "/v1/completions",
                      json={"prompt": "hello", "max_tokens": 6, "ignore_eos": True}, timeout=60)
    assert resp.status_code == 200
    name = "llmctl:{}_flops_total"
    deadline = time.monotonic() + 10  # the engine thread snapshots its stats when idle
    while True:
        after = httpx.get(served.url + "/metrics").text
        if _metric(after, name.format("decode")) > _metric(before, name.format("decode")) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for phase in ("prefill", "decode"):
        assert _metric(after, name.format(phase)) > _metric(before, name.format(phase))


def test_metrics_read_right_after_the_last_response_count_every_token(tiny_llama):
    """A bench scrapes /metrics the moment its last response ends (its closing scrape):
    the step that empties the engine is snapshotted before its outputs are delivered.
    Here the engine thread is held for 0.3 s after that step, as a descheduled thread
    would be; delivering first, the closing read saw the idle snapshot (0 FLOPs)."""
    import asyncio

    from llmctl.serve.engine.async_engine import AsyncEngine

    engine = LLM(str(tiny_llama), kv_cache_memory="32MiB").engine
    busy = engine.has_unfinished_requests

    def descheduled_when_idle() -> bool:
        if not (left := busy()):
            time.sleep(0.3)
        return left

    engine.has_unfinished_requests = descheduled_when_idle
    front = AsyncEngine(engine)
    front.start()

    async def run() -> dict:
        stream = front.submit("r0", [5, 17, 33], SamplingParams(max_tokens=4, temperature=0,
                                                                 ignore_eos=True))
        async for _ in front.outputs("r0", stream):
            pass
        return front.stats()  # what /metrics renders, read at once

    try:
        stats = asyncio.run(run())
    finally:
        front.shutdown()
    totals = stats.perf_totals
    assert totals["prefill"].flops > 0 and totals["decode"].flops > 0
    assert totals == engine.stats().perf_totals


def test_a_snapshot_from_before_a_burst_never_reads_as_idle(tiny_llama):
    """Snapshots are taken every 0.1 s while busy; a burst of submissions right after an
    idle snapshot, and a client that leaves as soon as it has its first tokens, found
    ``stats()`` still idle with the burst's requests running (test_load's 200 streams
    then 50 disconnects saw 12-29 open streams). Submitted requests count as waiting
    until a snapshot sees them (a step does not snapshot more often for it: stats()
    walks the batch)."""
    import asyncio
    import threading

    from llmctl.serve.engine.async_engine import AsyncEngine

    engine = LLM(str(tiny_llama), kv_cache_memory="32MiB").engine
    front = AsyncEngine(engine)
    front.start()
    step = engine.step
    hold, stepped = threading.Event(), threading.Event()

    def held_step():
        hold.wait(5)
        out = step()
        stepped.set()
        return out

    engine.step = held_step
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)

    async def run() -> tuple[EngineStats, EngineStats]:
        for _ in range(100):  # an idle snapshot first
            if front.stats().num_waiting == 0:
                break
            await asyncio.sleep(0.01)
        streams = [front.submit(f"r{i}", [5, 17, 33 + i], params) for i in range(3)]
        before = front.stats()  # the engine thread is held before its first step
        hold.set()
        await asyncio.to_thread(stepped.wait, 5)
        await asyncio.sleep(0.01)  # the step's outputs delivered (and snapshotted)
        after = front.stats()
        for i, stream in enumerate(streams):
            front.abort(f"r{i}")
            del stream
        return before, after

    try:
        before, after = asyncio.run(run())
    finally:
        front.shutdown()
    assert before.num_running + before.num_waiting == 3
    assert after.num_running + after.num_waiting == 3
