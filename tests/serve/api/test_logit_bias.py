"""OpenAI's ``logit_bias``: added to the raw logits before the greedy argmax and sampling,
checked token for token against a transformers greedy loop with the same bias; log-probs
stay those of the model's raw distribution (vLLM's default, ``raw_logprobs``)."""

import pickle

import httpx
import pytest
import torch
from openai import OpenAI

from llmctl.errors import UsageError
from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.sample.logits_process import apply_logit_bias
from tests.serve.api.conftest import start_server
from tests.serve.conftest import encode, hf_model

PROMPT = "The file object"
STEPS = 8
FORCED = 284  # "tion" in the tiny tokenizer: whole text, and not what the model writes


def test_apply_logit_bias_adds_in_float32_and_leaves_the_input():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.25, 0.125]], dtype=torch.bfloat16)
    out = apply_logit_bias(logits, [{0: 100.0, 2: -0.5}, None])
    assert out.dtype == torch.float32
    assert out.tolist() == [[101.0, 2.0, 2.5], [0.5, 0.25, 0.125]]
    assert logits.tolist() == [[1.0, 2.0, 3.0], [0.5, 0.25, 0.125]]  # logprobs read these
    assert apply_logit_bias(logits, [None, {}]) is logits


def test_sampling_params_check_and_pickle():
    params = SamplingParams(logit_bias={"5": -100, 7: 2.5})
    assert params.logit_bias == {5: -100.0, 7: 2.5}
    assert pickle.loads(pickle.dumps(params)) == params  # it crosses to engine processes
    for bad in ({1: 100.5}, {-1: 1.0}, {i: 1.0 for i in range(301)}):
        with pytest.raises(UsageError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def _reference(path, bias: dict[int, float]) -> tuple[list[int], torch.Tensor]:
    """transformers, float32: greedy with ``bias`` added every step (EOS not special, as
    with ignore_eos), and the first step's raw log-probabilities."""
    model = hf_model(str(path))
    ids = encode(path, PROMPT)
    out, first = [], None
    with torch.no_grad():
        for _ in range(STEPS):
            logits = model(torch.tensor([ids + out])).logits[0, -1].float()
            if first is None:
                first = torch.log_softmax(logits, dim=-1)
            for token, b in bias.items():
                logits[token] += b
            out.append(int(logits.argmax()))
    return out, first


def _complete(url: str, bias: dict[int, float] | None, **extra) -> dict:
    body = {"prompt": PROMPT, "max_tokens": STEPS, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "return_tokens_as_token_ids": True, **extra}
    if bias is not None:
        body["logit_bias"] = {str(k): v for k, v in bias.items()}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["logprobs"]


def _ids(logprobs: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]


@pytest.fixture(scope="module")
def raw(tiny_llama):
    """The unbiased greedy tokens and first-step log-probs (transformers)."""
    return _reference(tiny_llama, {})


def test_plus_100_forces_the_token_every_step(served, tiny_llama, raw):
    assert raw[0].count(FORCED) < STEPS // 2  # unbiased, the model writes other tokens
    got = _ids(_complete(served.url, {FORCED: 100}))
    assert got == [FORCED] * STEPS
    assert got == _reference(tiny_llama, {FORCED: 100})[0]


def test_minus_100_bans_the_greedy_token(served, tiny_llama, raw):
    plain, first = raw
    assert _ids(_complete(served.url, None)) == plain  # the unbiased engine agrees
    top1, top2 = first.topk(2).indices.tolist()
    assert plain[0] == top1
    expected, _ = _reference(tiny_llama, {top1: -100})
    logprobs = _complete(served.url, {top1: -100})
    got = _ids(logprobs)
    assert got == expected
    assert got[0] == top2  # the runner-up of the raw logits takes the first step
    assert top1 not in got
    assert got != plain
    # log-probs are the raw distribution's: the banned token keeps its raw -log p as the
    # top alternative (biased, it would be near -100); float32 engine vs float32
    # transformers differ by accumulation order only
    assert logprobs["token_logprobs"][0] == pytest.approx(float(first[top2]), abs=1e-4)
    top = logprobs["top_logprobs"][0]
    assert top[f"token_id:{top1}"] == pytest.approx(float(first[top1]), abs=1e-4)


def test_openai_client_chat_and_sampled(served):
    client = OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Say something."}]
    for temperature in (0, 1.0):  # +100 dominates a sampled draw too (p > 1 - 1e-30)
        out = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=5, temperature=temperature, seed=3,
            logit_bias={str(FORCED): 100}, logprobs=True,
            extra_body={"return_tokens_as_token_ids": True})
        tokens = [t.token for t in out.choices[0].logprobs.content]
        assert tokens == [f"token_id:{FORCED}"] * 5
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                    logit_bias={str(FORCED): 100},
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == served.server.frontend.tokenizer.decode([FORCED] * 4)


@pytest.mark.parametrize("bias,needle", [
    ({"abc": 1}, "'abc' is not a token id"),
    ({"-1": 1}, "'-1' is not a token id"),
    ({"1.5": 1}, "'1.5' is not a token id"),
    ({"1": 101}, "out of range; allowed: -100 <= bias <= 100"),
    ({"1": -100.5}, "out of range"),
    ({"1": 1e308}, "out of range"),
    ({"1": "much"}, "logit_bias.1"),
    ({str(i): 1 for i in range(301)}, "at most 300 tokens may be biased, got 301"),
    ({"100000": 1}, "token id 100000 is outside the vocabulary (0.."),
])
def test_bad_logit_bias_is_400(served, bias, needle):
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "x"}]})):
        resp = httpx.post(served.url + path, json={**body, "max_tokens": 2,
                                                   "logit_bias": bias})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert needle in error["message"]
        assert error["param"].startswith("logit_bias")


def test_vocabulary_bound(served):
    vocab = served.server.config.model.vocab_size
    body = {"prompt": "x", "max_tokens": 1, "temperature": 0}
    last = httpx.post(served.url + "/v1/completions",
                      json={**body, "logit_bias": {str(vocab - 1): 100}})
    assert last.status_code == 200
    assert last.json()["choices"][0]["text"] == served.server.frontend.tokenizer.decode([vocab - 1])
    past = httpx.post(served.url + "/v1/completions",
                      json={**body, "logit_bias": {str(vocab): 100}})
    assert past.status_code == 400 and f"token id {vocab} is outside" in past.text


def test_in_an_engine_process(tiny_llama, raw):
    top1 = raw[1].argmax().item()
    running = start_server(str(tiny_llama), engine_process=True)
    try:
        assert _ids(_complete(running.url, {FORCED: 100})) == [FORCED] * STEPS
        assert _ids(_complete(running.url, {top1: -100})) == \
            _reference(tiny_llama, {top1: -100})[0]
    finally:
        running.stop()
