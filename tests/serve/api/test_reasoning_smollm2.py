"""Reasoning on the real SmolLM2 (issue 36's real-model check): its chat template given
DeepSeek-R1's ending (the assistant turn opens ``<think>``; ``enable_thinking: false``
closes it empty), served with ``--reasoning-parser deepseek_r1``. SmolLM2 never writes
``</think>`` itself, so with thinking on its whole greedy answer is reasoning (``content``
null, every token a reasoning token, the finish the engine's own), and with thinking off
its whole answer is content; either way the text is exactly what the same engine
generates offline for the same prompt (float32 greedy), streamed or not."""

from __future__ import annotations

import shutil

import pytest
from openai import OpenAI

from tests.serve.api.test_reasoning_http import _start

pytestmark = pytest.mark.slow

R1_ENDING = (
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def thinking_smollm2(smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2-r1") / "smollm2-r1"
    shutil.copytree(smollm2, out)
    template = (out / "chat_template.jinja").read_text()
    marker = "{% if add_generation_prompt %}"
    assert marker in template  # SmolLM2's ChatML template ends with the assistant opening
    (out / "chat_template.jinja").write_text(template[:template.index(marker)] + R1_ENDING)
    return out


@pytest.fixture(scope="module")
def served(thinking_smollm2):
    running = _start(thinking_smollm2, {"max_model_len": 512, "dtype": "float32"},
                     reasoning_parser="deepseek_r1")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def offline(thinking_smollm2):
    """The engine's own greedy text for the prompt the server renders (no parser)."""
    from llmctl.serve.core.sampling_params import SamplingParams
    from llmctl.serve.engine.llm import LLM

    llm = LLM(str(thinking_smollm2), dtype="float32", kv_cache_memory="64MiB",
              max_model_len=512)
    tok = llm.engine.tokenizer
    texts = {}
    for thinking in (True, False):
        prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False,
                                         enable_thinking=thinking)
        assert prompt.endswith("<think>\n" if thinking else "</think>\n\n")
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        (out,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
        texts[thinking] = out.outputs[0].text, out.outputs[0].finish_reason
    return texts


@pytest.mark.parametrize("stream", [False, True])
def test_smollm2_thinking_is_all_reasoning_and_off_is_all_content(served, offline, stream):
    client = OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)

    def ask(thinking: bool):
        extra = {"chat_template_kwargs": {"enable_thinking": thinking}}
        if not stream:
            r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                               max_tokens=MAX_TOKENS, extra_body=extra)
            m = r.choices[0].message
            return (getattr(m, "reasoning", None), m.content, r.choices[0].finish_reason,
                    r.usage)
        reasoning, content, finish, usage = "", "", None, None
        for chunk in client.chat.completions.create(
                model="tiny", messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS,
                stream=True, stream_options={"include_usage": True}, extra_body=extra):
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning", None) or ""
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return reasoning or None, content or None, finish, usage

    reasoning, content, finish, usage = ask(True)
    assert "</think>" not in offline[True][0]  # SmolLM2 does not close the block itself
    assert (reasoning, finish) == offline[True] and content is None
    assert usage.completion_tokens_details.reasoning_tokens == usage.completion_tokens
    off_reasoning, off_content, _, off_usage = ask(False)
    assert off_reasoning is None and off_content == offline[False][0]
    assert not off_usage.completion_tokens_details or \
        not off_usage.completion_tokens_details.reasoning_tokens
