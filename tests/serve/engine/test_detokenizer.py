"""Incremental detokenization and stop strings (never leaked, even while streaming)."""

from __future__ import annotations

import pytest

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.detokenizer import IncrementalDetokenizer
from llmctl.serve.engine.llm import LLM
from tests.serve.conftest import PROMPTS, encode, hf_greedy, tokenizer

TEXTS = ["Hello world, the file object is open.", "naïve café — 漢字 and emoji 🙂 end",
         "  leading spaces\nand a newline\ttab"]


def feed(tok, prompt_ids, out_ids, **params):
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(**params))
    deltas, visible = [], []
    stopped = False
    for token in out_ids:
        stopped = detok.append(token)
        deltas.append(detok.delta())
        visible.append(detok.visible_text)
        if stopped:
            break
    detok.finish()
    deltas.append(detok.delta())
    return detok, deltas, visible, stopped


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tiny_llama, text):
    tok = tokenizer(str(tiny_llama))
    prompt = tok("The prompt:")["input_ids"]
    out = tok(text, add_special_tokens=False)["input_ids"]
    detok, deltas, _, _ = feed(tok, prompt, out)
    assert detok.text == tok.decode(out) == text
    assert "".join(deltas) == text


def test_stop_string_across_tokens_is_cut_and_never_streamed(tiny_llama):
    tok = tokenizer(str(tiny_llama))
    text = "Hello world. The end is near, STOP here please"
    out = tok(text, add_special_tokens=False)["input_ids"]
    detok, deltas, visible, stopped = feed(tok, [1], out, stop=["STOP", "never"])
    assert stopped and detok.stop_reason == "STOP"
    assert detok.text == "Hello world. The end is near, "
    assert "".join(deltas) == detok.text
    assert all(detok.text.startswith(v) for v in visible)  # nothing shown then retracted


def test_include_stop_string(tiny_llama):
    tok = tokenizer(str(tiny_llama))
    out = tok("abc xyz def", add_special_tokens=False)["input_ids"]
    detok, _, _, stopped = feed(tok, [1], out, stop=["xyz"], include_stop_str_in_output=True)
    assert stopped and detok.text == "abc xyz"


def test_held_back_prefix_is_released_when_it_is_not_a_stop(tiny_llama):
    tok = tokenizer(str(tiny_llama))
    out = tok("one STO two", add_special_tokens=False)["input_ids"]
    _, deltas, _, stopped = feed(tok, [1], out, stop=["STOP"])
    assert not stopped and "".join(deltas) == "one STO two"


def test_engine_stop_string_cuts_text_and_reports_it(tiny_llama):
    ids = encode(tiny_llama, PROMPTS[0])
    expected_ids = hf_greedy(tiny_llama, ids, 24)
    tok = tokenizer(str(tiny_llama))
    full = tok.decode(expected_ids, skip_special_tokens=True)
    stop = full[10:14]
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    out = llm.generate([ids], params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[:full.index(stop)]
    assert out.token_ids == expected_ids[:len(out.token_ids)]
    streamed = "".join(o.outputs[0].text_delta for o in llm.stream([ids], params))
    assert streamed == out.text and stop not in streamed
