"""The offline API and ``llmctl generate`` on the engine."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.llm import LLM
from tests.serve.conftest import PROMPTS, assert_all_blocks_free, encode, hf_greedy, hf_model


def test_logprobs_equal_transformers_log_softmax(tiny_llama):
    ids = encode(tiny_llama, PROMPTS[1])
    llm = LLM(str(tiny_llama), kv_cache_memory="4MiB")
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, logprobs=3))[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids) == 6
    with torch.inference_mode():
        logits = hf_model(str(tiny_llama))(torch.tensor([ids + comp.token_ids])).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    for i, (token, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = logp[len(ids) - 1 + i]
        assert lp.token_id == token
        assert abs(lp.logprob - float(row[token])) < 1e-4
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()


def test_prompt_text_and_token_ids_agree(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_memory="4MiB")
    params = SamplingParams(temperature=0, max_tokens=8)
    by_text = llm.generate(PROMPTS[0], params)[0]
    by_ids = llm.generate([encode(tiny_llama, PROMPTS[0])], params)[0]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.prompt == PROMPTS[0] and by_ids.prompt is None
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids


def test_sampled_n_with_prefix_cache_and_preemption_keeps_books(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=4, num_kv_blocks=40, max_model_len=120,
              max_num_batched_tokens=16)
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=30, n=3, seed=5,
                            ignore_eos=True)
    outs = llm.generate(PROMPTS[:4], params)
    assert all(len(o.outputs) == 3 for o in outs)
    assert all(len(c.token_ids) == 30 for o in outs for c in o.outputs)
    assert llm.engine.stats().num_preemptions > 0
    assert_all_blocks_free(llm.engine)
    again = LLM(str(tiny_llama), kv_cache_memory="8MiB").generate(PROMPTS[:4], params)
    # a seeded request gives the same tokens with or without preemption and caching
    assert [[c.token_ids for c in o.outputs] for o in outs] == \
        [[c.token_ids for c in o.outputs] for o in again]


def test_stream_stopped_early_frees_the_request(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_memory="4MiB")
    stream = llm.stream(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=50,
                                                    ignore_eos=True))
    next(stream)
    stream.close()
    assert_all_blocks_free(llm.engine)
    assert not llm.engine.has_unfinished_requests()


def test_cli_generate_backends_agree(tiny_llama):
    from llmctl.cli.app import build_app

    runner = CliRunner()
    app = build_app()
    args = ["generate", str(tiny_llama), "--prompt", "The file object", "--max-tokens", "12",
            "--dtype", "float32", "--json"]  # exact tokens: float32 only
    engine = json.loads(runner.invoke(app, args).stdout)
    hf = json.loads(runner.invoke(app, args + ["--backend", "transformers"]).stdout)
    assert engine["backend"] == "engine" and hf["backend"] == "transformers"
    assert engine["token_ids"] == hf["token_ids"] == hf_greedy(
        tiny_llama, encode(tiny_llama, "The file object"), 12)
    bad = runner.invoke(app, args + ["--backend", "tensorrt"])
    assert bad.exit_code == 2 and "unknown backend" in bad.output
