"""One request never hurts another over HTTP.

Out-of-range values are 400s before anything is queued; a failure inside one request's
processing (its constraint, the model pass over it) ends that request alone with a 500
in OpenAI's shape; streams already in flight finish with [DONE] and the tokens they get
alone (greedy, float32). An engine stops the tests' clock with :class:`EngineGate` so
"in flight" is certain, not a matter of timing.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.serve.api.conftest import EngineGate, start_server
from tests.serve.api.test_errors import _error, _wait_idle
from tests.serve.engine.test_llm_engine_isolation import FailingFactory

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
IN_FLIGHT = [
    (COMPLETIONS, {"prompt": "The file object", "max_tokens": 64, "temperature": 0,
                   "ignore_eos": True}),
    (COMPLETIONS, {"prompt": "In Python, a class", "max_tokens": 64, "temperature": 0.8,
                   "seed": 7, "ignore_eos": True}),
    (CHAT, {"messages": [{"role": "user", "content": "The import statement"}],
            "max_tokens": 64, "temperature": 0, "ignore_eos": True}),
]


class Stream(threading.Thread):
    """One streamed request on its own thread: status, SSE events, [DONE]."""

    def __init__(self, url: str, path: str, body: dict, headers: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, {**body, "stream": True}
        self.headers = headers
        self.status: int | None = None
        self.events: list[dict] = []
        self.done = False
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", self.url + self.path, json=self.body, headers=self.headers,
                          timeout=180) as resp:
            self.status = resp.status_code
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    self.events.append(json.loads(line[6:]))

    def finish(self) -> Stream:
        self.join(180)
        assert not self.is_alive()
        return self

    @property
    def text(self) -> str:
        return "".join(_choice_text(c) for e in self.events for c in e.get("choices", []))


def _choice_text(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _alone(url: str, path: str, body: dict) -> str:
    resp = httpx.post(url + path, json=body, timeout=180)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice.get("text") if "text" in choice else choice["message"]["content"]


def _wait_streams(running, count: int) -> None:
    deadline = time.monotonic() + 60
    while running.engine.num_streams < count:
        assert time.monotonic() < deadline, "the request was never submitted"
        time.sleep(0.01)


def _with_streams_in_flight(running, act):
    """Start IN_FLIGHT, hold the engine once they are all in it, ``act()``, release;
    every stream must then finish normally with its solo text."""
    expected = [_alone(running.url, path, body) for path, body in IN_FLIGHT]
    gate = EngineGate(running, len(IN_FLIGHT))
    try:
        streams = [Stream(running.url, path, body) for path, body in IN_FLIGHT]
        gate.wait()
        result = act()
    finally:
        gate.remove()
    for stream, text in zip(streams, expected):
        stream.finish()
        assert stream.status == 200 and stream.done, stream.events[-1:]
        assert not any("error" in e for e in stream.events)
        assert stream.text == text
    _wait_idle(running)
    return result


def test_seed_beyond_64_bits_is_400_and_streams_in_flight_finish(served):
    """The reported case: this body was a plain-text 500 and killed the other streams."""
    def act():
        return httpx.post(served.url + COMPLETIONS, timeout=60,
                          json={"prompt": "x", "seed": 18446744073709551616, "temperature": 1})

    resp = _with_streams_in_flight(served, act)
    assert resp.headers["content-type"].startswith("application/json")
    err = _error(resp, 400)
    assert err["type"] == "invalid_request_error" and err["param"] == "seed"
    assert err["code"] is None
    assert "-9223372036854775808 <= seed <= 18446744073709551615" in err["message"]
    assert "18446744073709551616" in err["message"]


def test_64_bit_seeds_work_and_wrap_like_torch(served):
    """Every signed and unsigned 64-bit seed is taken; -1 is 2**64 - 1 (torch's reading)."""
    def text(seed):
        return _alone(served.url, COMPLETIONS, {"prompt": "The file object", "max_tokens": 12,
                                                "temperature": 1.0, "seed": seed})

    assert text(-1) == text(2**64 - 1)
    assert text(-(2**63)) == text(2**63)
    assert text(0) != text(2**64 - 1)  # the seed does matter


class _Grammars:
    """Stands in for the server's GrammarFactory: every response_format gets a
    constraint that raises inside the engine."""

    def __init__(self, where: str) -> None:
        self.where = where

    def compiled(self, kind, schema):
        return FailingFactory(self.where)


@pytest.mark.parametrize("where,stream", [("mask", True), ("accept", False), ("fork", True)])
def test_failure_inside_one_request_ends_only_that_request(served, monkeypatch, where,
                                                           stream):
    monkeypatch.setattr(served.server.frontend.sampling, "grammars", _Grammars(where))
    body = {"prompt": "A", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "n": 2 if where == "fork" else 1, "response_format": {"type": "json_object"}}

    def act():
        if stream:
            bad = Stream(served.url, COMPLETIONS, body)
        else:
            result = {}
            bad = threading.Thread(target=lambda: result.setdefault(
                "resp", httpx.post(served.url + COMPLETIONS, json=body, timeout=180)))
            bad.start()
        _wait_streams(served, len(IN_FLIGHT) + 1)  # queued while the others run
        return bad, (None if stream else result)

    bad, result = _with_streams_in_flight(served, act)
    bad.join(180)
    if stream:
        assert bad.status == 200 and not bad.done
        err = bad.events[-1]["error"]
    else:
        resp = result["resp"]
        assert resp.headers["content-type"].startswith("application/json")
        err = _error(resp, 500)
    assert err["type"] == "server_error" and err["code"] == "internal_error"
    assert "Boom" in err["message"]


def test_model_pass_failure_for_one_request_ends_only_that_request(served, monkeypatch):
    """The batched forward pass raises whenever the bad request is in it: the engine
    re-runs the sequences alone and fails only the one that still raises."""
    bad_ids = [7, 8, 9, 10, 11]
    runner = served.engine.engine.runner
    real = runner.execute_with_prompt

    def execute_with_prompt(scheduled, with_prompt=True):
        if any(s.seq.request.prompt_token_ids == bad_ids and s.seq.num_output_tokens >= 2
               for s in scheduled):
            raise RuntimeError("kernel failed")
        return real(scheduled, with_prompt)

    monkeypatch.setattr(runner, "execute_with_prompt", execute_with_prompt)
    body = {"prompt": bad_ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True}

    def act():
        bad = Stream(served.url, COMPLETIONS, body)
        _wait_streams(served, len(IN_FLIGHT) + 1)
        return bad

    bad = _with_streams_in_flight(served, act).finish()
    assert bad.status == 200 and not bad.done
    err = bad.events[-1]["error"]
    assert err["code"] == "internal_error" and "kernel failed" in err["message"]


def test_unexpected_errors_are_openai_json_never_plain_text(served, monkeypatch):
    def broken(req):
        raise RuntimeError("a bug")

    monkeypatch.setattr(served.server.frontend.completions, "encode", broken)
    resp = httpx.post(served.url + COMPLETIONS, json={"prompt": "x"}, timeout=60)
    assert resp.headers["content-type"].startswith("application/json")
    err = _error(resp, 500)
    assert err["type"] == "server_error" and "RuntimeError: a bug" in err["message"]
    for method, path, status in [("GET", "/v1/nothing", 404), ("GET", COMPLETIONS, 405)]:
        err = _error(httpx.request(method, served.url + path, timeout=60), status)
        assert path in err["message"]
    assert httpx.get(served.url + "/health").status_code == 200


def test_engine_fault_outside_any_request_stops_the_server_cleanly(tiny_llama):
    """An exception out of step() itself (scheduler bookkeeping) is the engine's fault:
    every stream ends with a 503 event, /health turns 503, new requests get 503 JSON."""
    running = start_server(str(tiny_llama))
    try:
        gate = EngineGate(running, 1)
        try:
            stream = Stream(running.url, COMPLETIONS, IN_FLIGHT[0][1])
            gate.wait()

            def schedule():
                raise RuntimeError("books do not balance")

            running.engine.engine.scheduler.schedule = schedule
        finally:
            gate.remove()
        stream.finish()
        assert stream.status == 200 and not stream.done
        err = stream.events[-1]["error"]
        assert err["code"] == "unavailable" and "books do not balance" in err["message"]
        assert httpx.get(running.url + "/health").status_code == 503
        _error(httpx.post(running.url + COMPLETIONS, json={"prompt": "x"}, timeout=60), 503)
    finally:
        running.stop()
