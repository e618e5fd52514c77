"""``/tokenize`` and ``/detokenize`` in vLLM's request and response shapes: the ids are
the ones the generation endpoints use for the same text or conversation, and a bad body
is a 400 in OpenAI's error shape."""

from __future__ import annotations

import httpx
import pytest

from llmctl.models.loading import load_tokenizer

TEXT = "The quick brown fox jumps over the lazy dog."
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(tiny_llama)


def _post(served, path: str, body: dict, status: int = 200) -> dict:
    resp = httpx.post(served.url + path, json=body, timeout=60)
    assert resp.status_code == status, resp.text
    return resp.json()


def test_text_ids_are_the_completion_prompt_ids(served, tokenizer):
    out = _post(served, "/tokenize", {"model": "tiny", "prompt": TEXT})
    want = tokenizer(TEXT, add_special_tokens=True)["input_ids"]
    assert out == {"count": len(want), "max_model_len": served.server.config.model.max_model_len,
                   "tokens": want, "token_strs": None}
    usage = _post(served, "/v1/completions", {"prompt": TEXT, "max_tokens": 1})["usage"]
    assert usage["prompt_tokens"] == out["count"]
    # vLLM's benchmark client asks without special tokens, with token strings here
    bare = _post(served, "/tokenize", {"prompt": TEXT, "add_special_tokens": False,
                                       "return_token_strs": True})
    assert bare["tokens"] == tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(bare["tokens"])


def test_chat_ids_are_the_chat_prompt_ids(served, tokenizer):
    out = _post(served, "/tokenize", {"messages": CHAT})
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert out["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    usage = _post(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})["usage"]
    assert usage["prompt_tokens"] == out["count"]
    no_prompt = _post(served, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert no_prompt["count"] < out["count"]
    assert out["tokens"][:no_prompt["count"]] == no_prompt["tokens"]
    prefill = CHAT + [{"role": "assistant", "content": "Hel"}]
    cont = _post(served, "/tokenize", {"messages": prefill, "add_generation_prompt": False,
                                       "continue_final_message": True})
    assert tokenizer.decode(cont["tokens"]).endswith("Hel")  # left open, no end-of-turn


def test_detokenize_round_trips(served, tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert _post(served, "/detokenize", {"model": "tiny", "tokens": ids}) == {"prompt": TEXT}


@pytest.mark.parametrize(("path", "body", "status", "needle"), [
    ("/tokenize", {}, 400, "missing required parameter: prompt"),
    ("/tokenize", {"prompt": TEXT, "bogus": 1}, 400, "unrecognized request argument"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400,
     "cannot both be true"),
    ("/tokenize", {"model": "gpt-9", "prompt": TEXT}, 404, "gpt-9"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, 400, "outside the vocabulary"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_bad_bodies_get_openai_errors(served, path, body, status, needle):
    resp = httpx.post(served.url + path, json=body, timeout=60)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert needle in error["message"]
    assert set(error) >= {"message", "type", "param", "code"}
    # the server is unharmed
    assert _post(served, "/tokenize", {"prompt": "ok"})["count"] >= 1
