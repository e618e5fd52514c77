"""Tenants from ``--auth-file``: the file's checks, then a real server on the tiny model:
401 / 403 / 400 / 429 with OpenAI's headers, reservations settled to what requests
consumed (stopped early, aborted), SIGHUP reloads with requests in flight, per-tenant
metrics with a bounded label set, and the command line's refusals.

The limiter's clock is frozen during the HTTP tests, so every remaining count is exact:
nothing refills between two requests."""

import asyncio
import json
import logging
import re
import signal
import threading
import time

import httpx
import pytest
import yaml

from llmctl.errors import UsageError
from llmctl.serve.api.tenancy.keys import TenantTable, hash_key
from tests.serve.api.conftest import EngineGate, start_server
from tests.serve.api.test_isolation import Stream
from tests.serve.api.test_load import _metric

KEYS = {"rpm": "sk-rpm", "tok": "sk-tok", "cap": "sk-cap", "other": "sk-other",
        "free": "sk-free", "abort": "sk-abort", "once": "sk-once"}
TENANTS = {
    "rpm": {"priority_class": "interactive", "requests_per_minute": 2},
    "tok": {"output_tokens_per_minute": 100},
    "cap": {"max_tokens_per_request": 40},
    "other": {"models": ["other-model"]},
    "free": {"priority_class": "batch", "models": ["tiny", "other-model"]},
    "abort": {"output_tokens_per_minute": 1000, "tokens_per_day": 100_000},
    "once": {"requests_per_minute": 1, "output_tokens_per_minute": 50},
}
COMPLETIONS = "/v1/completions"


def auth_doc(keys=KEYS, tenants=TENANTS) -> dict:
    return {"tenants": tenants,
            "keys": [{"key_sha256": hash_key(key), "tenant": name} for name, key in keys.items()]}


def write(path, doc):
    path.write_text(yaml.safe_dump(doc) if isinstance(doc, dict) else doc)
    return path


def bearer(name_or_key: str) -> dict:
    return {"Authorization": f"Bearer {KEYS.get(name_or_key, name_or_key)}"}


# --- the file ---------------------------------------------------------------------------
def test_a_valid_file_maps_keys_to_tenants(tmp_path):
    doc = auth_doc()
    doc["keys"][0]["key_sha256"] = doc["keys"][0]["key_sha256"].upper()  # sha256sum -b | tr
    table = TenantTable.load(write(tmp_path / "k.yaml", doc))
    rpm = table.lookup("sk-rpm")
    assert (rpm.name, rpm.priority_class, rpm.limits.requests_per_minute) == (
        "rpm", "interactive", 2)
    assert table.lookup("sk-tok").priority_class == "standard"  # the default class
    assert table.lookup("sk-rpm ") is None and table.lookup("") is None
    assert table.lookup(b"sk-free").name == "free"
    assert not table.lookup("sk-other").may_use(("tiny",))
    assert table.lookup("sk-free").may_use(("x", "tiny"))
    # the documented way to make a digest: printf %s KEY | sha256sum
    assert hash_key("test") == "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"


SECRET = "sk-live-do-not-print"


@pytest.mark.parametrize("doc,needle,hint", [
    ({"tenants": {"a": {"requests_per_minit": 5}}, "keys": [{"key_sha256": "0" * 64,
                                                            "tenant": "a"}]},
     "tenants.a.requests_per_minit: unknown field", "tenants:"),
    ({"tenants": {"a": {}}, "keys": [{"key": SECRET, "tenant": "a"}]},
     "keys.0: plain keys are not accepted", "sha256sum"),
    ({"tenants": {"a": {}}, "keys": [{"key_sha256": SECRET, "tenant": "a"}]},
     "keys.0.key_sha256: String should match pattern", "sha256sum"),
    ({"tenants": {"a": {}}, "keys": [{"key_sha256": "0" * 64, "tenant": "b"}]},
     "names the tenant 'b', which is not under tenants (known: a)", "tenants:"),
    ({"tenants": {"a": {}}, "keys": [{"key_sha256": "0" * 64, "tenant": "a"},
                                     {"key_sha256": "0" * 64, "tenant": "a"}]},
     "keys[1] repeats an earlier key_sha256", "tenants:"),
    ({"tenants": {"a": {"priority_class": "realtime"}}, "keys": [{"key_sha256": "0" * 64,
                                                                 "tenant": "a"}]},
     "tenants.a.priority_class: Input should be 'interactive', 'standard' or 'batch'", ""),
    ({"tenants": {"a": {"tokens_per_day": 0}}, "keys": [{"key_sha256": "0" * 64,
                                                        "tenant": "a"}]},
     "tenants.a.tokens_per_day: Input should be greater than 0", ""),
    ({"tenants": {"unknown": {}}, "keys": [{"key_sha256": "0" * 64, "tenant": "unknown"}]},
     "'unknown' is reserved", ""),
    ({"tenants": {"a b": {}}, "keys": [{"key_sha256": "0" * 64, "tenant": "a b"}]},
     "tenants.a b.[key]: String should match pattern", ""),
    ({"tenants": {}, "keys": []}, "tenants: Dictionary should have at least 1 item", ""),
    ("tenants: [\n  - {key: " + SECRET, "is not valid YAML at line 2, column", "tenants:"),
    ("", "Input should be a valid dictionary", ""),
])
def test_a_bad_file_is_one_line_naming_the_problem_never_a_key(tmp_path, doc, needle, hint):
    path = write(tmp_path / "k.yaml", doc)
    with pytest.raises(UsageError) as info:
        TenantTable.load(path)
    err = info.value
    assert needle in err.message and str(path) in err.message, err.message
    assert hint in err.remedy
    assert "\n" not in err.message and SECRET not in str(err)


def test_an_unreadable_file_says_so(tmp_path):
    with pytest.raises(UsageError, match="cannot read --auth-file .*nope.yaml"):
        TenantTable.load(tmp_path / "nope.yaml")


# --- the server -------------------------------------------------------------------------
class FrozenClock:
    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def tenants(tiny_llama, tmp_path_factory):
    path = write(tmp_path_factory.mktemp("auth") / "keys.yaml", auth_doc())
    running = start_server(str(tiny_llama), auth_file=path)
    running.clock = FrozenClock()
    running.server.tenancy.limiter.clock = running.clock
    yield running
    running.stop()


def _post(running, who, body, path=COMPLETIONS):
    return httpx.post(running.url + path, json=body, headers=bearer(who), timeout=120)


def _metrics(running) -> str:
    # with keys, /metrics needs one too (it names every tenant): any tenant's will do
    return httpx.get(running.url + "/metrics", headers=bearer("tok")).text


def _rejections(running, tenant, reason) -> float:
    return _metric(_metrics(running), "llmctl:tenant_rejections_total", tenant=tenant,
                   reason=reason)


def _openai_error(resp, status, code):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err


def test_an_unknown_or_missing_key_is_401(tenants):
    before = _rejections(tenants, "unknown", "unauthorized")
    body = {"prompt": "x", "max_tokens": 1}
    for headers in ({}, bearer("sk-nobody"), {"Authorization": f"Basic {KEYS['free']}"},
                    {"Authorization": "Bearer"}):
        resp = httpx.post(tenants.url + COMPLETIONS, json=body, headers=headers)
        _openai_error(resp, 401, "invalid_api_key")
        assert resp.headers["www-authenticate"] == "Bearer"
    assert httpx.get(tenants.url + "/v1/models").status_code == 401
    assert httpx.get(tenants.url + "/health").status_code == 200  # no key needed
    assert _rejections(tenants, "unknown", "unauthorized") == before + 5
    # the scheme is case-insensitive (RFC 7235)
    ok = httpx.post(tenants.url + COMPLETIONS, json=body,
                    headers={"Authorization": f"bearer {KEYS['free']}"})
    assert ok.status_code == 200, ok.text


def test_a_key_for_another_model_is_403(tenants):
    before = _rejections(tenants, "other", "model_not_allowed")
    err = _openai_error(_post(tenants, "other", {"prompt": "x", "max_tokens": 1}), 403,
                        "model_not_allowed")
    assert err["type"] == "permission_error" and err["param"] == "model"
    _openai_error(_post(tenants, "other", {"model": "tiny", "messages": [
        {"role": "user", "content": "x"}], "max_tokens": 1}, "/v1/chat/completions"), 403,
        "model_not_allowed")
    assert _rejections(tenants, "other", "model_not_allowed") == before + 2
    # /v1/models lists what the key may use
    models = httpx.get(tenants.url + "/v1/models", headers=bearer("other")).json()
    assert models["data"] == []
    models = httpx.get(tenants.url + "/v1/models", headers=bearer("free")).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_requests_per_minute_429_with_openai_headers_and_retry_after(tenants, monkeypatch):
    engine = tenants.engine.engine
    seen = []
    real = engine.add_request

    def recording(*args, **kwargs):
        seen.append((kwargs.get("tenant"), kwargs.get("priority_class")))
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", recording)
    body = {"prompt": "x", "max_tokens": 2}
    first, second = _post(tenants, "rpm", body), _post(tenants, "rpm", body)
    assert first.status_code == second.status_code == 200
    # 2 per minute: one request refills in 30 s; the bucket is full 60 s after empty
    assert (first.headers["x-ratelimit-limit-requests"],
            first.headers["x-ratelimit-remaining-requests"],
            first.headers["x-ratelimit-reset-requests"]) == ("2", "1", "30s")
    assert (second.headers["x-ratelimit-remaining-requests"],
            second.headers["x-ratelimit-reset-requests"]) == ("0", "1m0s")
    assert "x-ratelimit-limit-tokens" not in first.headers  # rpm has no token limits
    assert seen == [("rpm", "interactive")] * 2

    third = _post(tenants, "rpm", body)
    err = _openai_error(third, 429, "rate_limit_exceeded")
    assert err["type"] == "requests"
    assert err["message"] == ("Rate limit reached for tenant 'rpm' on requests per min (RPM): "
                              "Limit 2, Used 2, Requested 1. Please try again in 30s.")
    assert third.headers["retry-after"] == "30"
    assert third.headers["retry-after-ms"] == "30000"
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    assert len(seen) == 2  # the refused request never reached the engine
    # another tenant is not affected
    assert _post(tenants, "free", body).status_code == 200
    assert seen[-1] == ("free", "batch")
    assert _rejections(tenants, "rpm", "requests") == 1
    assert _metric(_metrics(tenants), "llmctl:tenant_requests_total", tenant="rpm") == 2

    tenants.clock.t += 29.9
    _openai_error(_post(tenants, "rpm", body), 429, "rate_limit_exceeded")
    tenants.clock.t += 0.1
    assert _post(tenants, "rpm", body).status_code == 200


def test_max_tokens_over_the_keys_cap_is_400_and_an_unset_one_is_capped(tenants):
    err = _openai_error(_post(tenants, "cap", {"prompt": "x", "max_tokens": 41}), 400, None)
    assert err["param"] == "max_tokens" and "at most 40 per request" in err["message"]
    chat = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 41}
    err = _openai_error(_post(tenants, "cap", chat, "/v1/chat/completions"), 400, None)
    assert err["param"] == "max_completion_tokens"
    assert _rejections(tenants, "cap", "max_tokens") == 2
    ok = _post(tenants, "cap", {"prompt": "x", "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 40
    # without a cap, an unset max_tokens runs to the context (512 - prompt)
    free = _post(tenants, "free", {"prompt": [5] * 500, "ignore_eos": True})
    assert free.json()["usage"]["completion_tokens"] == 12


def test_a_request_that_stops_early_gives_back_its_unused_output_tokens(tenants):
    vocab = tenants.server.config.model.vocab_size
    # every token stops it: the first token generated ends the request
    body = {"prompt": "hello", "max_tokens": 40, "stop_token_ids": list(range(vocab))}
    first = _post(tenants, "tok", body)
    assert first.status_code == 200, first.text
    used = first.json()["usage"]["completion_tokens"]
    assert first.json()["choices"][0]["finish_reason"] == "stop" and used < 40
    assert first.headers["x-ratelimit-remaining-output-tokens"] == "60"  # 100 - 40 reserved
    second = _post(tenants, "tok", body)
    # without settling it would be 100 - 40 - 40 = 20
    assert second.headers["x-ratelimit-remaining-output-tokens"] == str(100 - used - 40)
    assert second.headers["x-ratelimit-remaining-tokens"] == str(100 - used - 40)
    assert second.headers["x-ratelimit-limit-tokens"] == "100"
    # the reservation of 60 + 40 can never fit 100: refused as too large, not to retry
    big = _post(tenants, "tok", {"prompt": "x", "max_tokens": 101})
    err = _openai_error(big, 429, "rate_limit_exceeded")
    assert err["type"] == "tokens" and "Request too large" in err["message"]
    assert big.headers["x-should-retry"] == "false" and "retry-after" not in big.headers


def test_a_request_the_engine_refuses_costs_the_tenant_nothing(tenants, monkeypatch):
    from llmctl.serve.engine.async_engine import QueueFullError

    def full():
        raise QueueFullError("full")

    body = {"prompt": "x", "max_tokens": 50}
    with monkeypatch.context() as m:
        m.setattr(tenants.engine, "check_capacity", full)
        _openai_error(_post(tenants, "once", body), 429, "queue_full")
    # the one request a minute and the 50 output tokens are still there
    ok = _post(tenants, "once", body)
    assert ok.status_code == 200, ok.text
    assert ok.headers["x-ratelimit-remaining-requests"] == "0"
    assert ok.headers["x-ratelimit-remaining-output-tokens"] == "0"


def _held_engine(running):
    """Hold the engine before its next step once a step has produced output, until the
    returned event is set: a request in flight stays in flight for as long as needed."""
    engine = running.engine.engine
    real = engine.step
    produced, release = threading.Event(), threading.Event()

    def step():
        if produced.is_set():
            release.wait(60)
        outputs = real()
        if outputs:
            produced.set()
        return outputs

    engine.step = step
    return produced, release


async def _abandon(url, body, headers, stream, produced):
    """Send, then leave once the engine has produced output (streaming: after reading
    the first event)."""
    async with httpx.AsyncClient(timeout=60) as client:
        if stream:
            async with client.stream("POST", url, json={**body, "stream": True},
                                     headers=headers) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        assert "error" not in json.loads(line[6:])
                        return
        task = asyncio.create_task(client.post(url, json=body, headers=headers))
        while not produced.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()


@pytest.mark.parametrize("stream", [True, False])
def test_an_aborted_request_is_charged_what_it_consumed(tenants, stream):
    limits = tenants.server.tenancy.table.tenants["abort"].limits
    limiter = tenants.server.tenancy.limiter

    def remaining():
        return {g.kind: g.remaining for g in limiter.status("abort", limits)}

    start = remaining()
    text = _metrics(tenants)
    gen0 = _metric(text, "llmctl:tenant_tokens_total", tenant="abort", kind="generation")
    prompt0 = _metric(text, "llmctl:tenant_tokens_total", tenant="abort", kind="prompt")
    produced, release = _held_engine(tenants)
    body = {"prompt": "The file object", "max_tokens": 400, "ignore_eos": True}
    try:
        asyncio.run(_abandon(tenants.url + COMPLETIONS, body, bearer("abort"), stream,
                             produced))
        deadline = time.monotonic() + 30  # the server notices the disconnect, settles
        while remaining()["output_tokens"] == start["output_tokens"] - 400:
            assert time.monotonic() < deadline, "the reservation was never settled"
            time.sleep(0.02)
    finally:
        release.set()
        del tenants.engine.engine.step
    text = _metrics(tenants)
    generated = _metric(text, "llmctl:tenant_tokens_total", tenant="abort",
                        kind="generation") - gen0
    prompt = _metric(text, "llmctl:tenant_tokens_total", tenant="abort", kind="prompt") - prompt0
    assert generated < 400 and prompt == len(tenants.server.frontend.tokenizer("The file object")[
        "input_ids"])
    after = remaining()
    assert after["output_tokens"] == start["output_tokens"] - generated
    assert after["tokens_day"] == start["tokens_day"] - prompt - generated


def test_metrics_count_per_tenant_with_a_bounded_label_set(tenants):
    text = _metrics(tenants)
    req0 = _metric(text, "llmctl:tenant_requests_total", tenant="free")
    gen0 = _metric(text, "llmctl:tenant_tokens_total", tenant="free", kind="generation")
    prompt0 = _metric(text, "llmctl:tenant_tokens_total", tenant="free", kind="prompt")
    plain = _post(tenants, "free", {"prompt": "abc", "max_tokens": 5, "n": 2,
                                    "ignore_eos": True}).json()["usage"]
    chunks = []
    with httpx.stream("POST", tenants.url + COMPLETIONS, headers=bearer("free"), timeout=60,
                      json={"prompt": ["a", "b c"], "max_tokens": 3, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert not any(h.startswith("x-ratelimit") for h in r.headers)  # no limits
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    streamed = chunks[-1]["usage"]
    for i in range(20):  # clients cannot add label values
        httpx.post(tenants.url + COMPLETIONS, json={"prompt": "x"}, headers=bearer(f"k{i}"))
    text = _metrics(tenants)
    assert _metric(text, "llmctl:tenant_requests_total", tenant="free") == req0 + 2
    assert _metric(text, "llmctl:tenant_tokens_total", tenant="free", kind="generation") == \
        gen0 + plain["completion_tokens"] + streamed["completion_tokens"] == gen0 + 10 + 6
    assert _metric(text, "llmctl:tenant_tokens_total", tenant="free", kind="prompt") == \
        prompt0 + plain["prompt_tokens"] + streamed["prompt_tokens"]
    labels = set(re.findall(r'tenant="([^"]*)"', text))
    assert labels <= set(TENANTS) | {"unknown"} and "unknown" in labels
    # every tenant of the file has its series from the start
    assert set(TENANTS) <= set(re.findall(r'tenant_requests_total\{[^}]*tenant="([^"]*)"',
                                          text))


# --- SIGHUP -----------------------------------------------------------------------------
def _send_sighup(running):
    """A real SIGHUP through the handler ``llmctl serve`` installs (the in-process server
    runs on a thread, where Python cannot install signal handlers)."""
    import uvicorn

    from llmctl.serve.launch.uvicorn_server import _GracefulServer

    handler = _GracefulServer(uvicorn.Config(app=None), running.engine, 1.0,
                              on_reload=running.server.tenancy.reload)
    # a stand-in underneath, so a missing handler fails the test instead of ending pytest
    missed = []
    previous = signal.signal(signal.SIGHUP, lambda sig, frame: missed.append(sig))
    try:
        with handler.capture_signals():
            signal.raise_signal(signal.SIGHUP)  # handled before raise_signal returns
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert not missed, "llmctl serve's SIGHUP handler was not installed"


def test_sighup_reloads_the_keys_with_requests_in_flight(tiny_llama, tmp_path, caplog):
    path = write(tmp_path / "keys.yaml", auth_doc())
    running = start_server(str(tiny_llama), auth_file=path)
    models = running.url + "/v1/models"
    try:
        gate = EngineGate(running, 1)
        try:
            inflight = Stream(running.url, COMPLETIONS,
                              {"prompt": "The file object", "max_tokens": 30,
                               "ignore_eos": True, "stream_options": {"include_usage": True}},
                              headers=bearer("free"))
            gate.wait()
            # free's key is revoked, a new tenant and key are added
            keys = {**{k: v for k, v in KEYS.items() if k != "free"}, "fresh": "sk-fresh"}
            write(path, auth_doc(keys, {**TENANTS, "fresh": {"requests_per_minute": 5}}))
            _send_sighup(running)
            assert httpx.get(models, headers=bearer("sk-fresh")).status_code == 200
            assert httpx.get(models, headers=bearer("free")).status_code == 401
            fresh = httpx.get(running.url + "/metrics", headers=bearer("sk-fresh")).text
            assert 'tenant="fresh"' in fresh
            # a bad file keeps the table in use, and says so in one line
            write(path, "tenants: {a: {priority_class: urgent}}\nkeys: [{key: sk-fresh}]")
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="llmctl.serve"):
                _send_sighup(running)
            (record,) = [r for r in caplog.records if "SIGHUP" in r.getMessage()]
            message = record.getMessage()
            assert record.levelno == logging.ERROR and "keeping the previous keys" in message
            assert "priority_class" in message and "sk-fresh" not in message
            assert httpx.get(models, headers=bearer("sk-fresh")).status_code == 200
        finally:
            gate.remove()
        inflight.join(120)
        # the request admitted under the revoked key ran to its end
        assert inflight.status == 200 and inflight.done
        assert not any("error" in e for e in inflight.events)
        assert inflight.events[-1]["usage"]["completion_tokens"] == 30
    finally:
        running.stop()


def test_llmctl_serve_installs_the_reload_only_with_an_auth_file(monkeypatch):
    """The wiring from ServeOptions to the SIGHUP handler (a real signal through that
    handler is the test above; without it SIGHUP would end the process)."""
    from types import SimpleNamespace

    from llmctl.serve.launch import assemble as launch
    from llmctl.serve.launch import uvicorn_server as server_module
    from llmctl.serve.launch.startup import ServeSettings

    fake = SimpleNamespace(tenancy=SimpleNamespace(reload=lambda: True))
    engine = SimpleNamespace(start=lambda: None, stats=dict, shutdown=lambda: None)
    installed = []
    monkeypatch.setattr(launch, "build_server", lambda opts: (fake, engine))
    monkeypatch.setattr(launch, "create_app", lambda server, on_shutdown: "app")
    monkeypatch.setattr(server_module._GracefulServer, "run",
                        lambda self: installed.append(self._on_reload))
    keyed = ServeSettings(model="m", auth_file="keys.yaml")
    assert launch.run_server(launch.ServeOptions(keyed)) == 0
    assert launch.run_server(launch.ServeOptions(ServeSettings(model="m", api_key="k"))) == 0
    assert installed == [fake.tenancy.reload, None]


# --- the command line -------------------------------------------------------------------
def test_command_line_refusals(tmp_path):
    from tests.cli.test_usage_errors import assert_usage_error, run

    good = write(tmp_path / "good.yaml", auth_doc())
    assert_usage_error(run("serve", "m", "--api-key", "K", "--auth-file", good), "--auth-file",
                       "--api-key")
    assert_usage_error(run("serve", "m", "--auth-file", good, env={"LLMCTL_API_KEY": "K"}),
                       "--auth-file")
    for engine in ("vllm", "trtllm"):
        assert_usage_error(run("serve", "m", "--engine", engine, "--auth-file", good),
                           "--auth-file", engine)
    bad = write(tmp_path / "bad.yaml", {"tenants": {"a": {"rpm": 1}}, "keys": []})
    assert_usage_error(run("serve", "m", "--auth-file", bad), "--auth-file",
                       "tenants.a.rpm: unknown field")
