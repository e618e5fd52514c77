"""``--reasoning-parser harmony`` (gpt-oss) over HTTP with the official openai client: the
tiny model with harmony's special tokens added to its tokenizer (special: the
detokenizer skips them), a harmony chat template and ``<|return|>``/``<|call|>`` as EOS,
and a scripted sampler (the real engine, detokenizer and API around it). The analysis
channel is the reasoning, the final channel the content, exactly at the channel
boundaries, streamed as whole; usage counts the analysis tokens; a length stop inside
the analysis gives the partial reasoning and no content; a grammar waits for the final
channel; a tokenizer without the tokens is refused at startup."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
from openai import OpenAI

from tests.serve.api.test_reasoning_http import _start, ids_of, streamed, whole

HARMONY_TEMPLATE = (
    "{% for m in messages %}{{ '<|start|>' + m['role'] + '<|message|>' + m['content'] + "
    "'<|end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant' }}"
    "{% endif %}")
SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>",
            "<|constrain|>"]
THOUGHT, ANSWER = "Let me think about it", "The answer is 4."
ANALYSIS = "<|channel|>analysis<|message|>"
TO_FINAL = "<|end|><|start|>assistant<|channel|>final<|message|>"


@pytest.fixture(scope="module")
def harmony_model(tiny_llama, tmp_path_factory):
    """tiny_llama with the harmony tokens (special, as gpt-oss has them), its embeddings
    grown to cover them, and gpt-oss's EOS ids (<|return|>, <|call|>, the tokenizer's)."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("harmony") / "tiny-harmony"
    shutil.copytree(tiny_llama, out)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.chat_template = HARMONY_TEMPLATE
    tok.save_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out))
    model.resize_token_embeddings(len(tok))
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids("<|return|>"),
                                            tok.convert_tokens_to_ids("<|call|>"),
                                            tok.eos_token_id]
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def served(harmony_model):
    running = _start(harmony_model, reasoning_parser="harmony")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(served):
    return served.engine.engine.tokenizer


@contextmanager
def scripted(served, output: str, seen: list | None = None):
    """The engine's sampler replaced: it writes ``output`` (harmony markup) token by
    token, then the real sampler goes on (until EOS or max_tokens). ``seen`` gets, for
    each scripted token, whether the step's constraint allowed it."""
    from llmctl.serve.sample.logits_process import apply_constraints

    engine = served.engine.engine
    ids = ids_of(engine.tokenizer, output)
    real = engine.sampler.sample

    def sample(logits, seqs):
        masked = apply_constraints(logits, [s.constraint for s in seqs])
        drawn = real(logits, seqs)
        out = []
        for row, seq in enumerate(seqs):
            at = len(seq.output_token_ids)
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


def test_split_at_the_channels_streamed_and_whole(client, served, tok):
    with scripted(served, f"{ANALYSIS}{THOUGHT}{TO_FINAL}{ANSWER}<|return|>"):
        got, stream = whole(client, max_tokens=80), streamed(client, max_tokens=80)
    reasoning, content, reason, usage = got
    assert (reasoning, content, reason) == (THOUGHT, ANSWER, "stop")
    assert usage["completion_tokens_details"]["reasoning_tokens"] == len(ids_of(tok, THOUGHT))
    assert usage["completion_tokens"] == len(ids_of(
        tok, f"{ANALYSIS}{THOUGHT}{TO_FINAL}{ANSWER}<|return|>"))
    assert stream == got


def test_a_preamble_is_content_and_analysis_may_come_twice(client, served):
    output = (f"{ANALYSIS}Hm.<|end|><|start|>assistant<|channel|>commentary<|message|>"
              f"Checking. <|end|><|start|>assistant{ANALYSIS} Yes.{TO_FINAL}4<|return|>")
    with scripted(served, output):
        got, stream = whole(client, max_tokens=80), streamed(client, max_tokens=80)
    assert got[:3] == ("Hm. Yes.", "Checking. 4", "stop") and stream == got


def test_length_inside_the_analysis(client, served, tok):
    cut = len(ids_of(tok, ANALYSIS)) + 2
    with scripted(served, f"{ANALYSIS}{THOUGHT}{TO_FINAL}{ANSWER}<|return|>"):
        got, stream = whole(client, max_tokens=cut), streamed(client, max_tokens=cut)
    reasoning, content, reason, usage = got
    assert reason == "length" and content is None
    assert reasoning == tok.decode(ids_of(tok, THOUGHT)[:2])
    assert THOUGHT.startswith(reasoning) and reasoning != THOUGHT
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 2
    assert stream == got


def test_the_grammar_applies_to_the_final_channel_only(client, served):
    seen: list[bool] = []
    with scripted(served, f"{ANALYSIS}{THOUGHT}{TO_FINAL}", seen=seen):
        reasoning, content, reason, _ = whole(
            client, max_tokens=60, response_format={"type": "json_object"})
    assert reasoning == THOUGHT
    assert seen and all(seen)  # no analysis or header token was masked by the grammar
    if reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # the tiny model may run out of tokens inside the object: still JSON's prefix
        assert content.lstrip().startswith("{")


def test_a_tokenizer_without_the_tokens_is_refused(tiny_llama):
    from llmctl.errors import UsageError

    with pytest.raises(UsageError, match="harmony tokens"):
        _start(tiny_llama, reasoning_parser="harmony")


TIME = {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["tz"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
ARGS = '{"tz": "CET"}'


def test_a_commentary_call_is_a_tool_call(client, served):
    sampling = served.server.frontend.sampling
    before, sampling.auto_tool_parser = sampling.auto_tool_parser, "openai"
    output = (f"{ANALYSIS}{THOUGHT}<|end|><|start|>assistant<|channel|>commentary"
              "<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
              f"to=functions.get_time <|constrain|>json<|message|>{ARGS}<|call|>")
    args = {"model": "tiny", "messages": [{"role": "user", "content": "Time?"}],
            "tools": TOOLS, "max_tokens": 120}
    try:
        with scripted(served, output):
            out = client.chat.completions.create(**args)
            chunks = list(client.chat.completions.create(stream=True, **args))
    finally:
        sampling.auto_tool_parser = before
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_dump()["reasoning"] == THOUGHT
    assert choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_time", ARGS)
    deltas = [c for d in chunks for c in d.choices]
    assert "".join(getattr(c.delta, "reasoning", None) or "" for c in deltas) == THOUGHT
    assert "".join(c.delta.content or "" for c in deltas) == "Checking."
    calls = [t for c in deltas for t in c.delta.tool_calls or ()]
    assert [t.function.name for t in calls if t.function.name] == ["get_time"]
    assert "".join(t.function.arguments or "" for t in calls) == ARGS
    assert [c.finish_reason for c in deltas if c.finish_reason] == ["tool_calls"]
