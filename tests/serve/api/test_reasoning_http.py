"""Reasoning output over HTTP with the official openai client: a tiny model whose
tokenizer has ``<think>``/``</think>`` as single tokens, a chat template that thinks
unless ``enable_thinking`` is false, and a scripted sampler (the real engine, detokenizer
and API around it) that thinks when the prompt leaves the thinking open. The split is
the same streamed and whole, in ``reasoning`` and ``reasoning_content`` and never in
``content``; usage counts the reasoning tokens; ``chat_template_kwargs`` reaches the
template; a length stop inside the thinking is no fake answer; a grammar waits for the
answer; malformed bodies are 400s while a stream in flight completes."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
from openai import OpenAI

from tests.cli.test_usage_errors import assert_usage_error, run
from tests.serve.api.conftest import Running, free_port

THINKING_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")
THOUGHT, ANSWER = "Let me think", "The answer is 4."
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def thinking_model(tiny_llama, tmp_path_factory):
    """tiny_llama with the think tags added to its tokenizer (one token each, not
    special: Qwen3's way) and its embeddings grown to cover them."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("thinking") / "tiny-thinking"
    shutil.copytree(tiny_llama, out)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = THINKING_CHATML
    tok.save_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out))
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(str(out))
    return out


def _start(model, engine: dict | None = None, **settings) -> Running:
    """conftest.start_server with serve settings of this feature (an in-process engine);
    ``engine``: EngineConfig keywords over the small defaults."""
    import uvicorn

    from llmctl.serve.api.app import create_app
    from llmctl.serve.launch.assemble import ServeOptions, build_server
    from llmctl.serve.launch.startup import ServeSettings

    opts = ServeOptions(
        ServeSettings(model=str(model), served_model_name="tiny", engine_process=False,
                      **settings),
        engine_kwargs={"kv_cache_memory": "64MiB", "max_num_seqs": 32,
                       "max_num_batched_tokens": 256, **(engine or {})})
    server, engine = build_server(opts)
    engine.start()
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(create_app(server, on_shutdown=engine.shutdown),
                                       host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=uv.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return Running(url, server, engine, uv)
        except httpx.HTTPError:
            time.sleep(0.05)
    raise RuntimeError("server did not come up")


@pytest.fixture(scope="module")
def served(thinking_model):
    running = _start(thinking_model, reasoning_parser="qwen3",
                     default_chat_template_kwargs='{"enable_thinking": true}')
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(served):
    return served.engine.engine.tokenizer


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@contextmanager
def scripted(served, thinking: str, answer: str | None = ANSWER, seen: list | None = None):
    """The engine's sampler replaced: when the prompt does not end the thinking (the
    template wrote no ``</think>``) it writes ``thinking`` first, then ``answer`` and
    EOS; ``answer`` None: the real (masked) sampler writes the answer. ``seen`` gets,
    for each scripted token, whether the step's constraint allowed it."""
    from llmctl.serve.sample.logits_process import apply_constraints

    engine = served.engine.engine
    tok = engine.tokenizer
    real = engine.sampler.sample
    eos = tok.eos_token_id

    def script(seq) -> list[int]:
        closed = tok.decode(seq.request.prompt_token_ids[-4:]).rstrip().endswith("</think>")
        head = [] if closed else ids_of(tok, thinking)
        return head + (ids_of(tok, answer) + [eos] if answer is not None else [])

    def sample(logits, seqs):
        masked = apply_constraints(logits, [s.constraint for s in seqs])
        drawn = real(logits, seqs)
        out = []
        for row, seq in enumerate(seqs):
            ids, at = script(seq), len(seq.output_token_ids)
            if at < len(ids):
                if seen is not None:
                    seen.append(bool(masked[row, ids[at]].isfinite()))
                out.append(ids[at])
            else:
                out.append(drawn[row])
        return out

    engine.sampler.sample = sample
    try:
        yield
    finally:
        del engine.sampler.sample


def whole(client, **kwargs) -> tuple[str | None, str | None, str, dict]:
    """(reasoning, content, finish_reason, usage) of a non-streamed answer."""
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                         **kwargs)
    message = out.choices[0].message.model_dump()
    assert message["reasoning"] == message["reasoning_content"]
    return (message["reasoning"], message["content"], out.choices[0].finish_reason,
            out.usage.model_dump())


def streamed(client, **kwargs) -> tuple[str | None, str | None, str, dict]:
    """The same, assembled from a stream's deltas (usage from its last chunk)."""
    reasoning, content, reason, usage = "", "", None, None
    for chunk in client.chat.completions.create(
            model="tiny", messages=MESSAGES, temperature=0, stream=True,
            stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            assert delta.get("reasoning") == delta.get("reasoning_content")
            assert not (delta.get("reasoning") and delta.get("content"))  # own deltas
            reasoning += delta.get("reasoning") or ""
            content += delta.get("content") or ""
            reason = choice.finish_reason or reason
    return reasoning or None, content or None, reason, usage


def test_split_at_the_tags_streamed_and_whole(client, served, tok):
    with scripted(served, f"<think>{THOUGHT}</think>"):
        got, stream = whole(client, max_tokens=60), streamed(client, max_tokens=60)
    reasoning, content, reason, usage = got
    assert (reasoning, content, reason) == (THOUGHT, ANSWER, "stop")
    details = usage["completion_tokens_details"]
    assert details["reasoning_tokens"] == len(ids_of(tok, THOUGHT))
    assert stream == got


def test_deepseek_r1_thinks_without_an_opening_tag(client, served):
    from llmctl.serve.openai.reasoning.parsers import DeepSeekR1ReasoningParser

    chat = served.server.frontend.chat
    before, chat.reasoning = chat.reasoning, DeepSeekR1ReasoningParser(chat.prompts.tokenizer)
    try:
        with scripted(served, f"{THOUGHT}</think>\n\n"):
            got, stream = whole(client, max_tokens=60), streamed(client, max_tokens=60)
            unterminated = whole(client, max_tokens=4)
    finally:
        chat.reasoning = before
    assert got[:3] == (THOUGHT, "\n\n" + ANSWER, "stop") and stream == got
    assert unterminated[1] is None and unterminated[2] == "length"


def test_split_by_text_where_tags_are_not_tokens(client, served):
    from llmctl.serve.openai.reasoning.split import ThinkTags

    parser = served.server.frontend.chat.reasoning
    before, parser.tags = parser.tags, ThinkTags()  # no ids: the text decides
    try:
        with scripted(served, f"<think>{THOUGHT}</think>"):
            got, stream = whole(client, max_tokens=60), streamed(client, max_tokens=60)
    finally:
        parser.tags = before
    assert got[:3] == (THOUGHT, ANSWER, "stop")
    assert stream[:3] == got[:3]


def test_enable_thinking_false_reaches_the_template(client, served):
    with scripted(served, f"<think>{THOUGHT}</think>"):
        thinking = whole(client, max_tokens=60)
        off = whole(client, max_tokens=60, extra_body=OFF)
        prompts = served.server.frontend.prompts
        before = prompts.default_template_kwargs
        prompts.default_template_kwargs = {"enable_thinking": False}  # as the flag sets it
        try:
            by_default = whole(client, max_tokens=60)
            overridden = whole(client, max_tokens=60,
                               extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        finally:
            prompts.default_template_kwargs = before
    assert off[:3] == (None, ANSWER, "stop") and by_default[:3] == off[:3]
    assert off[3]["completion_tokens_details"]["reasoning_tokens"] == 0
    # the template wrote the closed think block: a longer prompt
    assert off[3]["prompt_tokens"] > thinking[3]["prompt_tokens"]
    assert overridden == thinking


def test_length_inside_the_thinking(client, served):
    with scripted(served, f"<think>{THOUGHT}</think>"):
        got, stream = whole(client, max_tokens=3), streamed(client, max_tokens=3)
    reasoning, content, reason, usage = got
    assert reason == "length" and content is None
    assert reasoning and THOUGHT.startswith(reasoning) and reasoning != THOUGHT
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 2  # <think> is a tag
    assert stream == got


def test_the_grammar_applies_to_the_answer_only(client, served):
    seen: list[bool] = []
    with scripted(served, f"<think>{THOUGHT}</think>", answer=None, seen=seen):
        reasoning, content, reason, _ = whole(
            client, max_tokens=40, response_format={"type": "json_object"})
    assert reasoning == THOUGHT
    assert seen and all(seen)  # no thinking token was masked by the grammar
    if reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # the tiny model may run out of tokens inside the object: still JSON's prefix
        assert content.lstrip().startswith("{")


TIME = {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["tz"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
CALL = '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'


def test_tool_calls_are_read_from_the_answer_only(client, served):
    sampling = served.server.frontend.sampling
    before, sampling.auto_tool_parser = sampling.auto_tool_parser, "hermes"
    thought = f"Maybe {CALL.replace('CET', 'UTC')}? No."  # a call in the thinking is thought
    args = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 250}
    try:
        with scripted(served, f"<think>{thought}</think>", answer=CALL):
            out = client.chat.completions.create(**args)
            deltas = list(client.chat.completions.create(stream=True, **args))
    finally:
        sampling.auto_tool_parser = before
    choice = out.choices[0]
    assert choice.message.model_dump()["reasoning"] == thought
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time",
                                                                         {"tz": "CET"})
    streamed_reasoning = "".join(getattr(c.delta, "reasoning", None) or ""
                                 for d in deltas for c in d.choices)
    arguments = "".join(t.function.arguments or "" for d in deltas for c in d.choices
                        for t in c.delta.tool_calls or ())
    assert streamed_reasoning == thought and json.loads(arguments) == {"tz": "CET"}


def test_a_named_tool_grammar_waits_for_the_answer(client, served):
    seen: list[bool] = []
    with scripted(served, f"<think>{THOUGHT}</think>", answer=None, seen=seen):
        out = client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=40, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = out.choices[0]
    assert seen and all(seen)
    assert choice.message.model_dump()["reasoning"] == THOUGHT
    assert choice.finish_reason == "tool_calls"
    assert json.loads(choice.message.tool_calls[0].function.arguments)["tz"] in ("UTC", "CET")


def test_malformed_bodies_are_400s_while_a_stream_completes(client, served):
    bad = [({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
           ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
           ({"chat_template_kwargs": [1]}, "chat_template_kwargs")]
    reasoning, content = "", ""
    with scripted(served, f"<think>{THOUGHT}</think>"):
        stream = client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                max_tokens=60, stream=True)
        chunks = iter(stream)
        first = next(chunks)  # the stream is in flight
        for body, param in bad:
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="tiny", messages=MESSAGES,
                                               extra_body=body)
            assert err.value.status_code == 400
            assert err.value.body["param"] == param, err.value.body
        raw = httpx.post(served.url + "/v1/chat/completions", content=b'{"messages": [',
                         headers={"Content-Type": "application/json"})
        assert raw.status_code == 400 and raw.json()["error"]["type"]
        for chunk in [first, *chunks]:
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning", None) or ""
                content += choice.delta.content or ""
    assert (reasoning, content) == (THOUGHT, ANSWER)


def test_tokenize_takes_chat_template_kwargs(served, tok):
    body = {"model": "tiny", "messages": MESSAGES}
    plain = httpx.post(served.url + "/tokenize", json=body).json()["tokens"]
    off = httpx.post(served.url + "/tokenize", json={**body, **OFF}).json()["tokens"]
    assert off[:len(plain)] == plain and tok.decode(off[len(plain):]).strip() == (
        "<think>\n\n</think>")


def test_cli_refuses_unknown_parser_and_bad_json():
    assert_usage_error(run("serve", "m", "--reasoning-parser", "harmonyx"),
                       "--reasoning-parser", "deepseek_r1", "qwen3")
    assert_usage_error(run("serve", "m", "--default-chat-template-kwargs", "{bad"),
                       "--default-chat-template-kwargs", "not valid JSON")
    assert_usage_error(run("serve", "m", "--default-chat-template-kwargs", "[1]"),
                       "--default-chat-template-kwargs", "JSON object")


def test_cli_parser_names_are_the_registry():
    import typing

    from llmctl.cli.serve import ReasoningParser
    from llmctl.serve.openai.reasoning.parsers import REASONING_PARSERS

    literal = typing.get_args(typing.get_args(ReasoningParser)[0])[0]
    assert set(typing.get_args(literal)) == set(REASONING_PARSERS)


def test_hand_off_forwards_to_vllm_and_refuses_trtllm():
    import sys

    from llmctl.errors import UsageError
    from llmctl.serve.handoff.engines import HandoffOptions, refuse_unsupported, vllm_command

    cmd = vllm_command(HandoffOptions(model_path="p", served_name="s", host="h", port=1,
                                      python=sys.executable, reasoning_parser="qwen3",
                                      default_chat_template_kwargs='{"enable_thinking": false}'))
    assert cmd[-4:] == ["--reasoning-parser", "qwen3", "--default-chat-template-kwargs",
                        '{"enable_thinking": false}']
    refuse_unsupported("vllm", {"--reasoning-parser", "--default-chat-template-kwargs"})
    for flag in ("--reasoning-parser", "--default-chat-template-kwargs"):
        with pytest.raises(UsageError, match=flag):
            refuse_unsupported("trtllm", {flag})


def test_an_earlier_answers_reasoning_may_come_back(client, served):
    # clients replay the assistant message as they got it: both names are taken
    history = [*MESSAGES, {"role": "assistant", "content": "4", "reasoning_content": "2+2"},
               {"role": "user", "content": "And 3 + 3?"}]
    with scripted(served, f"<think>{THOUGHT}</think>"):
        out = client.chat.completions.create(model="tiny", messages=history, max_tokens=60)
    assert out.choices[0].message.content == ANSWER
