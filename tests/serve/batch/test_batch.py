"""``llmctl batch``'s runner against the HTTP server: for the same body, a batch line's
response is the server's (float32, greedy or seeded: the same tokens, text, logprobs and
usage; ids and ``created`` aside), failures included, and a resumed run completes the
output without repeating a line."""

import json
import math

import httpx
import pytest

from llmctl.serve.batch import files as batch_file
from llmctl.serve.batch.runner import run_batch

ENGINE = {"dtype": "float32", "kv_cache_memory": "64MiB", "max_num_seqs": 32,
          "max_num_batched_tokens": 256}
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a class in Python."}]

GOOD = {
    "cmpl-greedy": ("/v1/completions", {"model": "tiny", "prompt": "The file object",
                                        "max_tokens": 8, "temperature": 0}),
    "cmpl-two-prompts-n2": ("/v1/completions", {
        "prompt": ["In Python, a class is", "x"], "max_tokens": 6, "n": 2,
        "temperature": 0.9, "seed": 7}),
    "cmpl-echo-logprobs": ("/v1/completions", {"prompt": "The import statement",
                                               "max_tokens": 3, "echo": True, "logprobs": 2,
                                               "temperature": 0}),
    "cmpl-ids-stop": ("/v1/completions", {"prompt": [5, 17, 42, 99], "max_tokens": 12,
                                          "temperature": 0, "stop": ["e"],
                                          "return_tokens_as_token_ids": True}),
    "chat-greedy-logprobs": ("/v1/chat/completions", {
        "model": "tiny", "messages": CHAT, "max_tokens": 8, "temperature": 0,
        "logprobs": True, "top_logprobs": 2}),
    "chat-n3": ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 5,
                                         "n": 3, "temperature": 1.0, "seed": 3}),
    "embed-two": ("/v1/embeddings", {"model": "tiny", "input": ["x", "The file object"],
                                     "dimensions": 16}),
    "embed-base64": ("/v1/embeddings", {"input": [5, 17, 42], "encoding_format": "base64"}),
}
BAD = {  # what the HTTP API refuses, with the same status and error body
    "bad-range": ("/v1/completions", {"prompt": "x", "temperature": 5}),
    "bad-field": ("/v1/chat/completions", {"messages": CHAT, "modalities": ["audio"]}),
    "bad-model": ("/v1/completions", {"model": "gpt-4o", "prompt": "x"}),
    "too-long": ("/v1/completions", {"prompt": "x", "max_tokens": 100000}),
    "bad-token": ("/v1/completions", {"prompt": [1, 100000]}),
    "not-object": ("/v1/completions", ["x"]),
    "embed-empty": ("/v1/embeddings", {"input": ""}),
}


def _request_line(custom_id, url, body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _write_input(path, lines) -> None:
    path.write_text("\n".join(lines) + "\n")


def _read(path) -> dict:
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    by_key = {batch_file.output_key(x): x for x in lines}
    assert len(by_key) == len(lines), "a line was written twice"
    return by_key


def _same(got, want, where="body"):
    """Equal JSON, logprobs within 1e-4 (a sum over a batch of another shape may round
    differently in float32); ids and timestamps are per response."""
    if isinstance(want, dict):
        assert set(got) == set(want), where
        for key in want:
            if key not in ("id", "created", "request_id"):
                _same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert math.isclose(got, want, abs_tol=1e-4), (where, got, want)
    else:
        assert got == want, (where, got, want)


@pytest.fixture(scope="module")
def server(tiny_llama):
    from tests.serve.api.conftest import start_server

    running = start_server(str(tiny_llama), **ENGINE)
    yield running
    running.stop()


def _http(server, url, body):
    return httpx.post(server.url + url, json=body, timeout=120)


@pytest.fixture(scope="module")
def batch_run(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch")
    lines = [_request_line(cid, url, body) for cid, (url, body) in {**GOOD, **BAD}.items()]
    lines += ['{"custom_id": "half', _request_line("stream", "/v1/completions",
                                                    {"prompt": "x", "stream": True}),
              json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/completions",
                          "body": {}}),
              _request_line("moderate", "/v1/moderations", {"input": "x"})]
    _write_input(tmp / "in.jsonl", lines)
    summary = run_batch(tmp / "in.jsonl", tmp / "out.jsonl", str(tiny_llama), ENGINE,
                        served_model_name="tiny")
    return summary, _read(tmp / "out.jsonl"), len(lines)


def test_every_line_answers_as_the_server_does(server, batch_run):
    summary, out, count = batch_run
    assert len(out) == count and summary.written == count and not summary.interrupted
    for custom_id, (url, body) in {**GOOD, **BAD}.items():
        line = out[custom_id]
        want = _http(server, url, body)
        assert line["error"] is None and line["id"].startswith("batch_req_")
        assert line["response"]["status_code"] == want.status_code, custom_id
        _same(line["response"]["body"], want.json(), custom_id)
    assert all(out[c]["response"]["status_code"] == 200 for c in GOOD)
    assert out["cmpl-two-prompts-n2"]["response"]["body"]["choices"][3]["index"] == 3
    assert summary.failed == count - len(GOOD)
    assert summary.completion_tokens == sum(
        out[c]["response"]["body"]["usage"]["completion_tokens"] for c in GOOD)


def test_lines_that_are_no_request(batch_run):
    _, out, _ = batch_run
    half = out[len(GOOD) + len(BAD) + 1]  # no custom_id to name it: its line number does
    assert half["custom_id"] is None and half["response"] is None
    assert half["error"]["code"] == "invalid_json_line"
    assert out["get"]["error"]["code"] == "invalid_method" and out["get"]["response"] is None
    assert out["moderate"]["error"]["code"] == "invalid_url"
    stream = out["stream"]["response"]
    assert stream["status_code"] == 400 and stream["body"]["error"]["param"] == "stream"


def test_resume_after_a_crash_mid_write(tiny_llama, batch_run, tmp_path):
    """Keep the first lines of a finished output plus half of the next, as a crash would
    leave it: the rerun cuts the half line, runs only what is missing, repeats nothing."""
    _, first, _ = batch_run
    src = tmp_path / "in.jsonl"
    _write_input(src, [_request_line(cid, url, body) for cid, (url, body) in GOOD.items()])
    full = tmp_path / "full.jsonl"
    run_batch(src, full, str(tiny_llama), ENGINE, served_model_name="tiny")
    kept = full.read_text().splitlines(keepends=True)
    out = tmp_path / "out.jsonl"
    out.write_text("".join(kept[:2]) + kept[2][:40])
    said = []
    summary = run_batch(src, out, str(tiny_llama), ENGINE, served_model_name="tiny",
                        say=said.append)
    assert summary.skipped == 2 and summary.written == len(GOOD) - 2 and summary.failed == 0
    assert any("partial last line" in s for s in said), said
    resumed, once = _read(out), _read(full)
    assert set(resumed) == set(GOOD)
    for custom_id in GOOD:
        _same(resumed[custom_id]["response"], once[custom_id]["response"], custom_id)
        _same(resumed[custom_id]["response"], first[custom_id]["response"], custom_id)
    # a third run has nothing to do and loads no model
    again = run_batch(src, out, "no-such-model", ENGINE)
    assert (again.skipped, again.written) == (len(GOOD), 0)


def test_window_and_stop(tiny_llama, tmp_path, monkeypatch):
    """At most ``window`` sequences in the engine; a stop ends the run after the step
    with every finished line written, and the rerun does the rest."""
    from llmctl.serve.engine.llm_engine import LLMEngine

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_input(src, [_request_line(f"r{i}", "/v1/completions",
                                     {"prompt": f"The file object {i}", "max_tokens": 4 + i,
                                      "temperature": 0}) for i in range(8)])
    seen = []
    real = LLMEngine.step

    def step(self):
        seen.append(len(self.requests) + len(self._inbox))
        return real(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    written = []
    summary = run_batch(src, out, str(tiny_llama), ENGINE, window=3,
                        stop=lambda: any(written), progress=lambda d, t: written.append(d))
    assert max(seen) <= 3 and summary.interrupted
    assert 1 <= summary.written < 8 and len(_read(out)) == summary.written
    rest = run_batch(src, out, str(tiny_llama), ENGINE, window=3)
    assert not rest.interrupted and rest.skipped == summary.written
    assert set(_read(out)) == {f"r{i}" for i in range(8)}


def test_a_request_the_engine_fails_is_a_500_line(tiny_llama, tmp_path, monkeypatch):
    from llmctl.serve.engine.llm_engine import LLMEngine

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_input(src, [_request_line(c, "/v1/completions", {"prompt": [1, 2, 3] if c == "boom"
                                                            else "x", "max_tokens": 4})
                       for c in ("ok", "boom")])
    real = LLMEngine.step

    def step(self):
        outs = real(self)
        for o in outs:
            if o.prompt_token_ids == [1, 2, 3]:
                o.error, o.finished = "RuntimeError: kernel", True
        return outs

    monkeypatch.setattr(LLMEngine, "step", step)
    summary = run_batch(src, out, str(tiny_llama), ENGINE)
    lines = _read(out)
    assert lines["ok"]["response"]["status_code"] == 200 and summary.failed == 1
    assert lines["boom"]["response"]["status_code"] == 500
    assert lines["boom"]["response"]["body"]["error"] == {
        "message": "generation failed: RuntimeError: kernel", "type": "server_error",
        "param": None, "code": "internal_error"}


def test_sigint_asks_to_stop_and_the_handler_is_restored():
    import signal

    from llmctl.serve.batch.runner import stop_on_signals

    before = signal.getsignal(signal.SIGINT)
    with stop_on_signals() as stopped:
        assert not stopped()
        signal.raise_signal(signal.SIGINT)  # the first one only asks
        assert stopped()
        with pytest.raises(KeyboardInterrupt):  # a second one interrupts at once
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
