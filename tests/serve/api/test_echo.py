"""echo=true on /v1/completions: the prompt comes back, with its tokens' log-probs."""

import httpx
import pytest
import torch
from openai import OpenAI

from tests.serve.conftest import encode, hf_model, tokenizer

TEXT = "In Python, a class is a blueprint for objects and"


@pytest.fixture(scope="module")
def server(tiny_llama):
    from tests.serve.api.conftest import start_server

    running = start_server(str(tiny_llama), dtype="float32")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _reference(path, ids):
    with torch.inference_mode():
        logits = hf_model(str(path))(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_prompt_only_loglikelihood_request(client, tiny_llama):
    """What lm-eval and llmctl eval send: token ids, echo, max_tokens 0, logprobs 1."""
    ids = encode(tiny_llama, TEXT)
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True,
                                    logprobs=1, temperature=0)
    choice = out.choices[0]
    assert choice.text == tokenizer(str(tiny_llama)).decode(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _reference(tiny_llama, ids)
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), want, atol=1e-4, rtol=0)
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    assert choice.finish_reason == "length"


def test_echo_with_generation_text_and_token_ids(server, tiny_llama):
    body = {"prompt": TEXT, "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0,
            "return_tokens_as_token_ids": True}
    out = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    plain = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"prompt": TEXT, "max_tokens": 3, "temperature": 0}).json()
    choice = out["choices"][0]
    assert choice["text"] == TEXT + plain["choices"][0]["text"]
    ids = encode(tiny_llama, TEXT)
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 3
    assert lp["tokens"][:len(ids)] == [f"token_id:{i}" for i in ids]
    assert all(k.startswith("token_id:") for t in lp["top_logprobs"][1:] for k in t)
    assert out["usage"]["completion_tokens"] == 3


def test_echo_without_logprobs_and_streamed(client):
    out = client.completions.create(model="tiny", prompt=[TEXT, "x"], max_tokens=2, echo=True,
                                    temperature=0)
    assert [c.text[:len(p)] for c, p in zip(out.choices, [TEXT, "x"])] == [TEXT, "x"]
    assert all(c.logprobs is None for c in out.choices)
    stream = client.completions.create(model="tiny", prompt=TEXT, max_tokens=2, echo=True,
                                       temperature=0, stream=True)
    chunks = [c.choices[0].text for c in stream if c.choices]
    assert chunks[0].startswith(TEXT)
    assert "".join(chunks) == out.choices[0].text


def test_max_tokens_zero_needs_echo(server):
    resp = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert resp.status_code == 400 and "echo" in resp.json()["error"]["message"]
    resp = httpx.post(server.url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})
    assert resp.status_code == 400
