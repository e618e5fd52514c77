"""Structured output in the engine: masks before sampling, per-sequence state, preemption."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.llm import LLM
from llmctl.serve.sample.logits_process import apply_constraints
from tests.serve.conftest import PROMPTS, assert_all_blocks_free

# bounded, so even a random model's output is short: every token must be grammar-forced
# or chosen among few options, and the object closes within max_tokens
SCHEMA = {"type": "object",
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                         "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}


class AllowOnly:
    """A test constraint: one allowed token per step from a script; records what it saw."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.accepted: list[int] = []

    def mask(self, logits: torch.Tensor) -> None:
        keep = self.script[len(self.accepted)]
        value = logits[keep].clone()
        logits.fill_(float("-inf"))
        logits[keep] = value

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)

    def is_finished(self) -> bool:
        return len(self.accepted) == len(self.script)


class Scripted:
    """ConstraintFactory of AllowOnly constraints; keeps every constraint it made."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.made: list[AllowOnly] = []

    def new_constraint(self) -> AllowOnly:
        self.made.append(AllowOnly(self.script))
        return self.made[-1]


@pytest.fixture(scope="module")
def grammars(tiny_llama):
    from llmctl.models.loading import load_tokenizer
    from llmctl.serve.sample.grammar import GrammarFactory

    return GrammarFactory(load_tokenizer(tiny_llama), 512)


def test_apply_constraints_masks_only_constrained_rows_and_copies():
    logits = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    masked = apply_constraints(logits, [None, AllowOnly([1])])
    assert torch.equal(masked[0], logits[0])
    assert masked[1].isinf().sum() == 5 and masked[1, 1] == 7.0
    assert not logits.isinf().any()  # raw logits (for logprobs) untouched
    assert apply_constraints(logits, [None, None]) is logits


def test_non_factory_is_refused():
    from llmctl.errors import UsageError

    with pytest.raises(UsageError, match="logits_constraint"):
        SamplingParams(logits_constraint="json")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_mask_beats_argmax_and_stops_when_finished(tiny_llama, temperature):
    """The script forces tokens the model would not choose; the constraint finishing
    ends the sequence ("stop") although EOS is ignored and max_tokens is far."""
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    free = llm.generate(["The file object"], SamplingParams(temperature=0, max_tokens=4))
    script = [t + 1 for t in free[0].outputs[0].token_ids[:3]]  # never the argmax
    factory = Scripted(script)
    out = llm.generate(["The file object"], SamplingParams(
        temperature=temperature, seed=1, max_tokens=20, ignore_eos=True,
        logits_constraint=factory, logprobs=1))[0].outputs[0]
    assert out.token_ids == script
    assert out.finish_reason == "stop"
    assert factory.made[0].accepted == script
    # logprobs are the raw model's: the greedy token (not the forced one) stays on top
    assert out.logprobs[0].top[0][0] == free[0].outputs[0].token_ids[0]


def test_each_of_n_sequences_has_its_own_state(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    factory = Scripted([5, 6, 7, 8])
    out = llm.generate(["x"], SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=10,
                                             logits_constraint=factory))[0]
    assert [c.token_ids for c in out.outputs] == [[5, 6, 7, 8]] * 3
    assert len(factory.made) == 3
    assert all(c.accepted == [5, 6, 7, 8] for c in factory.made)


def test_preemption_does_not_feed_the_constraint_twice(tiny_llama):
    # 30 blocks of 4 tokens for six sequences of up to ~80 tokens: preemption by recompute
    llm = LLM(str(tiny_llama), block_size=4, num_kv_blocks=30, max_model_len=112,
              max_num_batched_tokens=512)
    script = list(range(10, 40))
    factories = [Scripted(script) for _ in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                             logits_constraint=f) for f in factories]
    outs = llm.generate(PROMPTS, params)
    assert llm.engine.stats().num_preemptions > 0
    for out, factory in zip(outs, factories):
        assert out.outputs[0].token_ids == script
        assert [c.accepted for c in factory.made] == [script]
    assert_all_blocks_free(llm.engine)


def _check(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


def test_json_schema_greedy(tiny_llama, grammars):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    params = SamplingParams(temperature=0, max_tokens=48,
                            logits_constraint=grammars.compiled("json_schema", SCHEMA))
    for out in llm.generate(PROMPTS[:3], params):
        assert out.outputs[0].finish_reason == "stop"
        _check(out.outputs[0].text)


def test_json_schema_sampled_n2_and_under_preemption(tiny_llama, grammars):
    llm = LLM(str(tiny_llama), block_size=4, num_kv_blocks=30, max_model_len=112,
              max_num_batched_tokens=512)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=40,
                            logits_constraint=grammars.compiled("json_schema", SCHEMA))
    outs = llm.generate(PROMPTS, params)
    assert llm.engine.stats().num_preemptions > 0
    texts = [c.text for out in outs for c in out.outputs]
    assert len(texts) == 2 * len(PROMPTS)
    for text in texts:
        _check(text)
    assert len(set(texts)) > 1  # sampled, not forced: the constraint leaves choices open
    assert_all_blocks_free(llm.engine)


def test_no_drafts_for_constrained_sequences(tiny_llama, grammars):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB",
              speculative={"method": "ngram", "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0, max_tokens=48,
                            logits_constraint=grammars.compiled("json_schema", SCHEMA))
    outs = llm.generate(PROMPTS[:3], params)
    for out in outs:
        _check(out.outputs[0].text)
    assert llm.engine.stats().spec_draft_tokens == 0


@pytest.mark.slow
def test_smollm2_chat_follows_a_schema(smollm2):
    from llmctl.models.prompting import encode_prompt
    from llmctl.serve.sample.grammar import GrammarFactory

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    llm = LLM(str(smollm2), max_model_len=256, kv_cache_memory="64MiB")
    grammars = GrammarFactory(llm.tokenizer, llm.engine.spec.vocab_size)
    ids = encode_prompt(llm.tokenizer, "Describe a person called Ann who is 31 as JSON.",
                        chat=True)
    out = llm.generate([ids], SamplingParams(
        temperature=0, max_tokens=48,
        logits_constraint=grammars.compiled("json_schema", schema)))[0].outputs[0]
    assert out.finish_reason == "stop"
    value = json.loads(out.text)
    jsonschema.validate(value, schema)
