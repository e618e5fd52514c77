"""The request features beyond plain sampling on CUDA, each against the CPU or
transformers: logit_bias, structured output (an llguidance mask moved to the device),
n > 1 with a seed, prompt logprobs, embeddings (pooled hidden states). The first device
check found every sampled request failing there (CPU parameter vectors mixed into CUDA
logits); these are the other per-row paths that build tensors beside the logits."""

from __future__ import annotations

import json

import pytest
import torch

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.llm import LLM
from tests.gpu.common import GPU, device_name, record
from tests.serve.conftest import PROMPTS, assert_all_blocks_free, encode

pytestmark = GPU
SCHEMA = {"type": "object",
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                         "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}


def _llm(path, **config) -> LLM:
    llm = LLM(str(path), device=device_name(), kv_cache_memory="8MiB", **config)
    assert llm.engine.device.type == device_name()
    return llm


def test_logit_bias_forces_its_token_with_logprobs(tiny_llama):
    llm = _llm(tiny_llama)
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.7, seed=5, max_tokens=8,
                                                   ignore_eos=True, logit_bias={7: 100.0},
                                                   logprobs=2))
    for o in out:
        assert o.error is None and o.outputs[0].token_ids == [7] * 8, o.error
        assert len(o.outputs[0].logprobs) == 8
    assert_all_blocks_free(llm.engine)


def test_json_schema_constrains_greedy_and_sampled_rows(tiny_llama):
    from llmctl.models.loading import load_tokenizer
    from llmctl.serve.sample.grammar import GrammarFactory

    grammars = GrammarFactory(load_tokenizer(tiny_llama), 512)
    llm = _llm(tiny_llama)
    params = [SamplingParams(temperature=t, seed=3, max_tokens=48,
                             logits_constraint=grammars.compiled("json_schema", SCHEMA))
              for t in (0.0, 1.0)]
    for out in llm.generate(PROMPTS[:2], params):
        assert out.error is None and out.outputs[0].finish_reason == "stop", out.error
        value = json.loads(out.outputs[0].text)  # the schema, by hand (no jsonschema there)
        assert set(value) == {"a", "b"} and isinstance(value["b"], bool)
        assert isinstance(value["a"], int) and 0 <= value["a"] <= 99


def test_n2_with_a_seed_gives_the_same_pair_twice(tiny_llama):
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    runs = [[[c.token_ids for c in o.outputs] for o in _llm(tiny_llama).generate(PROMPTS[:2],
                                                                                  params)]
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert all(len(pair) == 2 and all(len(t) == 12 for t in pair) for pair in runs[0])


def test_prompt_logprobs_equal_the_cpus(tiny_llama):
    ids = encode(tiny_llama, PROMPTS[3])
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    dev = _llm(tiny_llama).generate([ids], params)[0].prompt_logprobs
    cpu = LLM(str(tiny_llama), device="cpu", kv_cache_memory="8MiB").generate(
        [ids], params)[0].prompt_logprobs
    assert dev[0] is None and cpu[0] is None
    gap = max(abs(a.logprob - b.logprob) for a, b in zip(dev[1:], cpu[1:]))
    record("prompt_logprobs", max_abs_gap=gap, positions=len(ids) - 1)
    assert gap <= 1e-4  # float32 on both, summation order apart
    assert [a.top[0][0] for a in dev[1:]] == [b.top[0][0] for b in cpu[1:]]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers(tiny_llama, pooling):
    from transformers import AutoModelForCausalLM

    ids = encode(tiny_llama, PROMPTS[1])
    llm = _llm(tiny_llama)
    out = llm.generate([ids], SamplingParams(pooling=pooling))[0]
    assert out.error is None, out.error
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    with torch.inference_mode():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
    want = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    gap = (torch.tensor(out.embedding) - want).abs().max().item()
    record(f"embeddings[{pooling}]", max_abs_gap=gap)
    assert gap <= 1e-4 * max(1.0, want.abs().max().item())
