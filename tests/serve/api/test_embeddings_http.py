"""``POST /v1/embeddings`` through the official openai client against a real server:
the vectors equal transformers' pooled final hidden states (``AutoModel``'s
``last_hidden_state``, after the final norm), single and batched, from text and token
ids; ``dimensions`` and base64; malformed bodies are 400s naming the param; a stream in
flight is unharmed."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import openai
import pytest
import torch
from openai import OpenAI

from tests.serve.api.conftest import start_server

TOL = 1e-5


@pytest.fixture(scope="module")
def server(tiny_llama):
    running = start_server(str(tiny_llama))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """``(ids, pooling) -> unit vector`` from transformers in float32."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()

    def embed(ids: list[int], pooling: str) -> np.ndarray:
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        vec = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
        return vec.numpy().astype(np.float64)

    return embed


@pytest.fixture(scope="module")
def tokenize(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    return lambda text, special=True: tok(text, add_special_tokens=special)["input_ids"]


@pytest.fixture(params=["last", "mean"])
def pooling(request, server):
    """The server's --pooling, set on its frontend for one test (a flag at launch)."""
    serving = server.server.frontend.embeddings
    before = serving.pooling
    serving.pooling = request.param
    yield request.param
    serving.pooling = before


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def vectors(response) -> list[np.ndarray]:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    return [np.asarray(d.embedding, dtype=np.float64) for d in response.data]


TEXTS = ["The file object",
         "a much longer sentence, so the prompts differ in length and the batch pads nothing",
         "x"]


def test_single_equals_transformers(client, reference, tokenize, pooling):
    out = client.embeddings.create(model="tiny", input=TEXTS[1], encoding_format="float")
    (got,) = vectors(out)
    want = unit(reference(tokenize(TEXTS[1]), pooling))
    assert got.shape == (64,)
    assert np.abs(got - want).max() < TOL
    assert abs(np.linalg.norm(got) - 1) < 1e-6
    assert out.usage.prompt_tokens == out.usage.total_tokens == len(tokenize(TEXTS[1]))
    assert out.model == "tiny" and out.object == "list"


def test_batched_equals_one_by_one(client, reference, tokenize, pooling):
    # a repeated input: the second copy may come from the prefix cache (last pooling)
    texts = TEXTS + [TEXTS[1]]
    batched = vectors(client.embeddings.create(model="tiny", input=texts,
                                               encoding_format="float"))
    for text, got in zip(texts, batched):
        alone = vectors(client.embeddings.create(model="tiny", input=text,
                                                 encoding_format="float"))[0]
        assert np.abs(got - alone).max() < TOL
        assert np.abs(got - unit(reference(tokenize(text), pooling))).max() < TOL


def test_token_id_inputs(client, reference, pooling):
    # one prompt longer than a step's 256 tokens: it is prefilled in chunks
    long = [1] + [(7 * i) % 90 + 3 for i in range(299)]
    short = [1, 20, 21, 22]
    one = vectors(client.embeddings.create(model="tiny", input=short, encoding_format="float"))
    many = vectors(client.embeddings.create(model="tiny", input=[short, long],
                                            encoding_format="float"))
    assert np.abs(one[0] - many[0]).max() < TOL
    for ids, got in zip([short, long], many):
        assert np.abs(got - unit(reference(ids, pooling))).max() < TOL


def test_dimensions_truncate_then_normalise(client, reference, tokenize):
    out = client.embeddings.create(model="tiny", input=TEXTS[0], dimensions=8,
                                   encoding_format="float")
    (got,) = vectors(out)
    want = unit(reference(tokenize(TEXTS[0]), "last")[:8])
    assert got.shape == (8,)
    assert np.abs(got - want).max() < TOL


def test_base64_decodes_to_the_float_vector(client, server):
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    # the SDK asks for base64 when no format is given, and decodes it (float32, LE)
    decoded = client.embeddings.create(model="tiny", input=TEXTS)
    raw = httpx.post(server.url + "/v1/embeddings", json={
        "model": "tiny", "input": TEXTS[0], "encoding_format": "base64"}).json()
    assert isinstance(raw["data"][0]["embedding"], str)
    for a, b in zip(floats.data, decoded.data):
        assert list(a.embedding) == list(b.embedding)


def test_dimensions_too_large_is_a_400_through_the_sdk(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="tiny", input="hi", dimensions=65)
    assert info.value.body["param"] == "dimensions"


BAD_BODIES = [
    ({"model": "tiny"}, "input"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": {"text": "a"}}, "input"),
    ({"input": [-1]}, "input"),
    ({"input": [10**9]}, "input"),  # outside the vocabulary
    ({"input": [1] * 513}, "input"),  # over the context of 512 tokens
    ({"input": "a " * 5000}, "input"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "dimensions": 65}, "dimensions"),
    ({"input": "a", "dimensions": 8.5}, "dimensions"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "stream": True}, "stream"),
    ({"input": "a", "normalize": False}, "normalize"),
]


@pytest.mark.parametrize(("body", "param"), BAD_BODIES)
def test_malformed_bodies_are_400s_naming_the_param(server, body, param):
    r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["message"]


def test_a_prompt_filling_the_context_is_embedded(server):
    r = httpx.post(server.url + "/v1/embeddings", json={"input": [1] * 512}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 512


def test_unknown_model_is_a_404(server):
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "nope", "input": "a"})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model"


def test_vllm_extensions(client, server, reference, tokenize):
    raw = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float",
                                   extra_body={"use_activation": False,
                                               "add_special_tokens": False})
    want = reference(tokenize(TEXTS[0], special=False), "last")  # not normalised
    assert np.abs(vectors(raw)[0] - want).max() < TOL * max(1.0, np.abs(want).max())


def test_a_stream_in_flight_completes_while_embeddings_arrive(client, server):
    messages = [{"role": "user", "content": "Tell me a story"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=48,
                                          temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=48,
                                            temperature=0, stream=True)
    chunks = iter(stream)
    first = next(chunks)  # the stream is in flight now
    answers: list[int] = []

    def embed() -> None:
        for body in ({"input": TEXTS}, {"input": ""}, {"input": [1] * 600},
                     {"input": [[1, 2], [1] * 300]}, {"input": "a", "dimensions": 99}):
            answers.append(httpx.post(server.url + "/v1/embeddings", json=body,
                                      timeout=60).status_code)

    side = threading.Thread(target=embed)
    side.start()
    rest = list(chunks)
    side.join(60)
    text = "".join(c.choices[0].delta.content or "" for c in [first, *rest] if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in rest if c.choices and
            c.choices[0].finish_reason] == ["length"]
    assert answers == [200, 400, 400, 200, 400]


def test_counted_in_metrics(server, client):
    def finished() -> float:
        text = httpx.get(server.url + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("llmctl:request_success_total"))

    before = finished()
    client.embeddings.create(model="tiny", input=["a", "b"])
    assert finished() == before + 2
    assert server.engine.engine.block_manager.num_free_blocks == \
        server.engine.engine.block_manager.num_blocks  # no KV kept after

