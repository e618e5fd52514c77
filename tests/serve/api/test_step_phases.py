"""Where a step's time goes: the engine sums the wall time of each phase of ``step()``,
offline (``stats()``) and behind the server (``/metrics``)."""

from __future__ import annotations

import time

import httpx

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.llm import LLM
from llmctl.serve.engine.llm_engine import STEP_PHASES
from tests.serve.api.test_load import _metric


def test_phases_sum_to_at_most_the_wall_time_and_forward_dominates(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_memory="32MiB")
    assert llm.engine.stats().step_phase_seconds == dict.fromkeys(STEP_PHASES, 0.0)
    start = time.perf_counter()
    outs = llm.generate([[5, 17, 33, 99]] * 4, SamplingParams(max_tokens=16, temperature=0,
                                                               ignore_eos=True))
    wall = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    phases = llm.engine.stats().step_phase_seconds
    assert list(phases) == list(STEP_PHASES)
    assert all(seconds > 0 for seconds in phases.values()), phases
    assert sum(phases.values()) <= wall
    # the model pass is the largest phase even on a 2-layer model
    assert phases["forward"] == max(phases.values())


def test_metrics_expose_the_phases(served):
    before = httpx.get(served.url + "/metrics").text
    resp = httpx.post(served.url + "/v1/completions",
                      json={"prompt": "hello", "max_tokens": 8, "ignore_eos": True}, timeout=60)
    assert resp.status_code == 200
    name = "llmctl:engine_step_phase_seconds_total"
    deadline = time.monotonic() + 10  # the engine thread snapshots its stats when idle
    while True:
        after = httpx.get(served.url + "/metrics").text
        if _metric(after, name, phase="forward") > _metric(before, name, phase="forward") \
                or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for phase in STEP_PHASES:
        assert _metric(after, name, phase=phase) >= _metric(before, name, phase=phase)
    assert _metric(after, name, phase="forward") > _metric(before, name, phase="forward")
