"""The server over engine processes: the same tokens as the in-process engine, and what a
crash, a hung step, a leak and a second replica do to requests, /health and /metrics.

Greedy float32 on the tiny model, so every token is compared exactly with the in-process
engine's (the same code in another process). Faults are injected through
``$LLMCTL_ENGINE_FAULT`` (llmctl.serve.proc.child) or a real SIGKILL of the engine pid.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from llmctl.serve.proc.engine import FAULT_ENV, Supervision
from tests.serve.api.conftest import start_server
from tests.serve.api.test_isolation import Stream
from tests.serve.api.test_load import _metric

BODY = {"prompt": "The file object", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
# a grammar compiled in the API process travels as text and compiles again in the engine's
JSON = {"messages": [{"role": "user", "content": "a user"}], "max_tokens": 30,
        "temperature": 0, "response_format": {"type": "json_object"}}


def _complete(url: str, body: dict = BODY) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def _tokens(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """What the in-process engine answers (the exact tokens every test expects)."""
    running = start_server(str(tiny_llama))
    try:
        yield {"plain": _tokens(_complete(running.url)),
               "long": _tokens(_complete(running.url, {**BODY, "max_tokens": 200})),
               "json": _chat(running.url, JSON)}
    finally:
        running.stop()


def _chat(url: str, body: dict) -> str:
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


def _healthy_within(url: str, seconds: float) -> float:
    """Seconds until /health answers 200 (fails after ``seconds``)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"not healthy within {seconds} s")


def _pids(running) -> list[int]:
    return [r.pid for r in running.engine.engine.replicas]


def test_same_tokens_as_in_process_and_supervisor_metrics(tiny_llama, reference):
    running = start_server(str(tiny_llama), engine_process=True)
    try:
        assert _tokens(_complete(running.url)) == reference["plain"]
        # a service manager's stop signals every process of the service (systemd's
        # KillMode=control-group): the engine and its forkserver outlive SIGTERM, the API
        # process decides when they stop (after draining its streams)
        pid = _pids(running)[0]
        forkserver = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        assert forkserver not in (os.getpid(), 1)
        for target in (pid, forkserver):
            os.kill(target, signal.SIGTERM)
        time.sleep(0.5)
        assert _pids(running) == [pid] and os.path.exists(f"/proc/{forkserver}")
        body = {**BODY, "max_tokens": 200, "stream": True}
        stream = Stream(running.url, "/v1/completions", body).finish()
        assert stream.status == 200 and stream.done
        assert stream.text == reference["long"]
        assert _chat(running.url, JSON) == reference["json"]
        assert reference["json"].startswith("{")
        metrics = httpx.get(running.url + "/metrics").text
        assert _metric(metrics, "llmctl:engine_restarts_total") == 0
        assert _metric(metrics, "llmctl:engine_replicas_up") == 1
        assert _pids(running)[0] != os.getpid()
    finally:
        running.stop()


def test_sigkill_under_64_streams_ends_every_stream_and_recovers(tiny_llama, reference):
    """The issue's test: SIGKILL the engine with 64 streams open. Every stream ends (an
    error event marked retryable, or a 503 before its headers), /health is 503 until a
    new engine is ready, then 200; the next request gets the reference tokens."""
    running = start_server(str(tiny_llama), engine_process=True)
    try:
        body = {**BODY, "max_tokens": 400}
        streams = [Stream(running.url, "/v1/completions", body) for _ in range(64)]
        deadline = time.monotonic() + 60
        while sum(bool(s.events) for s in streams) < 16:  # many mid-generation
            assert time.monotonic() < deadline, "the streams never started"
            time.sleep(0.005)
        pid = _pids(running)[0]
        _assert_niced(pid, threads=2)  # two CPUs: torch's pool has a second thread
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for s in streams:
            s.finish()  # joins with a timeout and asserts the thread ended: no hang
        ended = time.monotonic() - killed
        errors = [s.events[-1]["error"] for s in streams if s.events and "error" in s.events[-1]]
        assert all(not s.done for s in streams)  # none was cut and reported as complete
        assert len(errors) == sum(s.status == 200 for s in streams) >= 16
        assert all(e["code"] == "unavailable" and "retry" in e["message"] for e in errors)
        assert "SIGKILL" in errors[0]["message"]
        assert all(s.status in (200, 503) for s in streams)
        health = httpx.get(running.url + "/health", timeout=5).status_code
        to_healthy = _healthy_within(running.url, 60)
        print(f"64 streams ended {ended:.2f} s after SIGKILL; healthy again after "
              f"{to_healthy:.2f} s more (/health was {health} meanwhile)")
        assert _pids(running)[0] != pid
        assert _tokens(_complete(running.url)) == reference["plain"]
        metrics = httpx.get(running.url + "/metrics").text
        assert _metric(metrics, "llmctl:engine_restarts_total") == 1
    finally:
        running.stop()


def test_requests_during_a_restart_get_503_with_retry_after(tiny_llama, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "crash@2")
    running = start_server(str(tiny_llama), engine_process=True)
    try:
        resp = _complete(running.url)  # its engine kills itself after two steps
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "unavailable"
        assert "SIGKILL" in resp.json()["error"]["message"]
        refused = _complete(running.url)  # the engine is still loading
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert "restarting" in refused.json()["error"]["message"]
        assert httpx.get(running.url + "/health").status_code == 503
        _healthy_within(running.url, 60)
        assert _complete(running.url).status_code == 200  # the fault was the first engine's
    finally:
        running.stop()


def test_a_hung_step_is_detected_within_the_limit(tiny_llama, monkeypatch, reference):
    monkeypatch.setenv(FAULT_ENV, "hang@3")
    limit = 1.5
    running = start_server(str(tiny_llama), engine_process=True,
                           supervision=Supervision(step_timeout=limit))
    try:
        stream = Stream(running.url, "/v1/completions", {**BODY, "max_tokens": 200})
        while not stream.events:
            time.sleep(0.005)
        stream.finish()
        error = stream.events[-1]["error"]
        assert "no progress for 1.5 s" in error["message"], error
        _healthy_within(running.url, 60)
        assert _tokens(_complete(running.url)) == reference["plain"]
    finally:
        running.stop()


def test_hung_step_detection_time(tiny_llama, monkeypatch):
    """From the engine's last message to its kill: within the limit plus the supervisor's
    50 ms wait (and scheduling slack on a loaded machine)."""
    from llmctl.serve.core.sampling_params import SamplingParams
    from llmctl.serve.proc.engine import ProcessEngine

    monkeypatch.setenv(FAULT_ENV, "hang@3")
    limit = 1.0
    engine = ProcessEngine(str(tiny_llama), {"kv_cache_memory": "64MiB", "dtype": "float32"},
                           Supervision(step_timeout=limit)).start()
    try:
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0))
        outputs = []
        while not any(o.finished for o in outputs):
            outputs += engine.step()
        last_heard = engine.replicas[0].last_heard
        detected = time.monotonic() - last_heard
        assert outputs[-1].retryable and "no progress" in outputs[-1].error
        assert sum(len(o.outputs[0].new_token_ids) for o in outputs if o.outputs) == 3
        assert limit <= detected < limit + 0.5, detected
    finally:
        engine.close()


def test_over_max_rss_the_engine_drains_then_restarts(tiny_llama, monkeypatch, reference):
    """grow@8 keeps 8 MiB more per step: the engine passes --max-rss (64 MiB over an idle
    engine's RSS) within its first 8 steps of a 200-token request. The request in flight
    still finishes whole (a drain, not a kill); then the engine restarts and serves the
    next request. RSS is read every 20 ms here (1 s by default) so the drain starts at
    once instead of after the request has grown for a second."""
    from llmctl.serve.proc import engine as proc_engine
    from llmctl.serve.proc.engine import ProcessEngine

    monkeypatch.setattr(proc_engine, "_RSS_EVERY", 0.02)
    probe = ProcessEngine(str(tiny_llama), {"kv_cache_memory": "64MiB"}).start()
    baseline = probe.replicas[0].rss_bytes()
    probe.close()
    monkeypatch.setenv(FAULT_ENV, "grow@8")
    running = start_server(str(tiny_llama), engine_process=True,
                           supervision=Supervision(max_rss=baseline + (64 << 20)))
    try:
        pid = _pids(running)[0]
        body = {**BODY, "max_tokens": 200}
        assert _tokens(_complete(running.url, body)) == reference["long"]
        deadline = time.monotonic() + 60
        while _pids(running)[0] == pid or httpx.get(running.url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the engine was not restarted"
            time.sleep(0.05)
        metrics = httpx.get(running.url + "/metrics").text
        assert _metric(metrics, "llmctl:engine_restarts_total") == 1
        assert _tokens(_complete(running.url)) == reference["plain"]
    finally:
        running.stop()


def _assert_niced(pid: int, threads: int = 1) -> None:
    """Every thread of the engine process (torch's pool included) runs at the default
    --engine-nice 10 above this process."""
    want = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
    tasks = os.listdir(f"/proc/{pid}/task")
    # /proc/PID/task/TID/stat: field 19 is the niceness (the command name may hold spaces)
    nice = {int(open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[16])
            for t in tasks}
    assert len(tasks) >= threads and nice == {want}


def test_two_replicas_one_dies_the_other_serves(tiny_llama, reference):
    running = start_server(str(tiny_llama), engine_process=True,
                           supervision=Supervision(replicas=2))
    try:
        engine = running.engine.engine
        assert [r.spec.cpus for r in engine.replicas] == [
            (c,) for c in sorted(os.sched_getaffinity(0))[:2]]
        for replica in engine.replicas:
            _assert_niced(replica.pid)
        assert _tokens(_complete(running.url)) == reference["plain"]
        os.kill(engine.replicas[0].pid, signal.SIGKILL)
        # replica 1 serves at once: healthy throughout, same tokens
        for _ in range(4):
            assert httpx.get(running.url + "/health").status_code == 200
            assert _tokens(_complete(running.url)) == reference["plain"]
        _healthy_within(running.url, 60)
        deadline = time.monotonic() + 60
        while _metric(httpx.get(running.url + "/metrics").text,
                      "llmctl:engine_replicas_up") != 2:
            assert time.monotonic() < deadline, "replica 0 did not come back"
            time.sleep(0.05)
        assert _metric(httpx.get(running.url + "/metrics").text,
                       "llmctl:engine_restarts_total") == 1
    finally:
        running.stop()
