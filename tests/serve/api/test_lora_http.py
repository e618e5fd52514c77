"""LoRA adapters through the HTTP API and the openai client, over engine processes (the
default) and in-process, and through ``llmctl batch``'s request path.

Every answer is compared with the offline engine (LLM) on the same adapter, which
tests/serve/lora/test_lora.py holds to PEFT's logits; greedy float32, so texts are equal.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai import OpenAI

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.llm import LLM
from tests.serve.api.conftest import start_server

PROMPT = "The file object"
MESSAGES = [{"role": "user", "content": "Hi"}]
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def offline(tiny_llama, tiny_loras):
    llm = LLM(str(tiny_llama), loras={k: str(v) for k, v in tiny_loras.items()},
              kv_cache_memory="16MiB")
    tok = llm.tokenizer
    chat_ids = tok(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    answers = {}
    for name in (None, "all4", "some8", "attn1"):
        answers[name, "completion"] = llm.generate(PROMPT, params, lora=name)[0].outputs[0].text
        answers[name, "chat"] = llm.generate([chat_ids], params, lora=name)[0].outputs[0].text
    assert len({answers[n, "completion"] for n in (None, "all4", "some8", "attn1")}) == 4
    return answers


@pytest.fixture(scope="module")
def proc_server(tiny_llama, tiny_loras):
    running = start_server(str(tiny_llama), engine_process=True, lora_runtime_updates=True,
                           loras={"all4": str(tiny_loras["all4"]),
                                  "some8": str(tiny_loras["some8"])})
    yield running
    running.stop()


@pytest.fixture(scope="module")
def inproc_server(tiny_llama, tiny_loras):
    running = start_server(str(tiny_llama), loras={"some8": str(tiny_loras["some8"])})
    yield running
    running.stop()


def _client(running) -> OpenAI:
    return OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)


def _ask(client: OpenAI, model: str) -> tuple[str, str]:
    kwargs = dict(model=model, max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"ignore_eos": True})
    completion = client.completions.create(prompt=PROMPT, **kwargs)
    chat = client.chat.completions.create(messages=MESSAGES, **kwargs)
    assert completion.model == chat.model == model
    return completion.choices[0].text, chat.choices[0].message.content


def test_adapters_and_base_answer_as_offline(proc_server, offline):
    client = _client(proc_server)
    for name in ("all4", "some8"):
        assert _ask(client, name) == (offline[name, "completion"], offline[name, "chat"])
    assert _ask(client, "tiny") == (offline[None, "completion"], offline[None, "chat"])


def test_models_list_adapters_under_the_base(proc_server):
    cards = {m.id: m for m in _client(proc_server).models.list().data}
    assert set(cards) == {"tiny", "all4", "some8"}
    assert cards["tiny"].parent is None
    assert cards["all4"].parent == cards["some8"].parent == "tiny"


def test_unknown_model_is_404(proc_server):
    with pytest.raises(openai.NotFoundError) as info:
        _client(proc_server).completions.create(model="nope", prompt=PROMPT, max_tokens=1)
    assert info.value.code == "model_not_found"


def test_load_use_unload(proc_server, tiny_loras, offline):
    url, client = proc_server.url, _client(proc_server)
    path = str(tiny_loras["attn1"])
    resp = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "attn1",
                                                           "lora_path": path})
    assert resp.status_code == 200, resp.text
    assert _ask(client, "attn1") == (offline["attn1", "completion"], offline["attn1", "chat"])
    assert "attn1" in {m.id for m in client.models.list().data}
    again = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "attn1",
                                                            "lora_path": path})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    resp = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "attn1"})
    assert resp.status_code == 200, resp.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="attn1", prompt=PROMPT, max_tokens=1)
    gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "attn1"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("body, status, message", [
    ({"lora_name": "x", "lora_path": "/no/such/dir"}, 400, "not a valid adapter"),
    ({"lora_name": "tiny", "lora_path": "/tmp"}, 400, "the base model's name"),
    ({"lora_name": "x"}, 400, "lora_path: Field required"),
])
def test_bad_loads_are_400(proc_server, body, status, message):
    resp = httpx.post(proc_server.url + "/v1/load_lora_adapter", json=body)
    assert resp.status_code == status, resp.text
    assert message in resp.json()["error"]["message"]


def test_in_process_engine_serves_adapters_and_refuses_updates(inproc_server, tiny_loras,
                                                                offline):
    client = _client(inproc_server)
    assert _ask(client, "some8") == (offline["some8", "completion"], offline["some8", "chat"])
    for route, body in (("load", {"lora_name": "x", "lora_path": str(tiny_loras["all4"])}),
                        ("unload", {"lora_name": "some8"})):
        resp = httpx.post(f"{inproc_server.url}/v1/{route}_lora_adapter", json=body)
        assert resp.status_code == 403
        assert "--enable-lora-runtime-updates" in resp.json()["error"]["message"]
    assert "some8" in {m.id for m in client.models.list().data}


def test_batch_lines_name_adapters(tiny_llama, tiny_loras, offline, tmp_path):
    from llmctl.serve.batch.runner import run_batch

    lines = [{"custom_id": name, "method": "POST", "url": "/v1/completions",
              "body": {"model": name, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True}} for name in ("all4", "nope")]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", str(tiny_llama),
              {"kv_cache_memory": "16MiB", "loras": {"all4": str(tiny_loras["all4"])}},
              served_model_name="tiny")
    out = {line["custom_id"]: line["response"] for line in
           map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert out["all4"]["body"]["choices"][0]["text"] == offline["all4", "completion"]
    assert out["nope"]["status_code"] == 404
