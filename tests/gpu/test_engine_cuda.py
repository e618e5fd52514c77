"""The serving engine on CUDA: greedy tokens equal transformers' on the CPU (float32,
the tiny model's widened weights make greedy choices decisive) through the paged KV
cache's gather/SDPA path, chunked prefill, preemption, prefix-cache hits, speculative
decoding, and the int8 and fp8 caches against transformers with K/V quantized the same
way. On CUDA the engine has no native kernels (llmctl.serve.kernels.cpu is CPU only):
these tests are about every tensor being where the step expects it."""

from __future__ import annotations

import pytest
import torch

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.llm import LLM
from llmctl.serve.layers.kv_quant import (
    dequantize_fp8,
    dequantize_int8,
    quantize_fp8,
    quantize_int8,
)
from tests.gpu.common import GPU, REAL_CUDA, device_name
from tests.serve.conftest import PROMPTS, assert_all_blocks_free, encode, hf_greedy
from tests.serve.kv_quant_engine import check, quantized_reference

pytestmark = GPU
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def _llm(path, **config) -> LLM:
    llm = LLM(str(path), device=device_name(), **config)
    assert llm.engine.device.type == device_name()
    assert llm.engine.target.kv_cache.device.type == device_name()
    assert llm.engine.runner.kernel is None or device_name() == "cpu"  # no CUDA kernels
    return llm


def _check_against_hf(path, llm: LLM, prompts=PROMPTS, params=GREEDY) -> list:
    ids = [encode(path, p) for p in prompts]
    outs = llm.generate(ids, params)
    for prompt_ids, out in zip(ids, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt_ids, params.max_tokens), \
            out.request_id
    assert_all_blocks_free(llm.engine)
    return outs


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_mixed_batch_equals_transformers(tiny_llama, prefix_caching):
    llm = _llm(tiny_llama, enable_prefix_caching=prefix_caching, kv_cache_memory="8MiB")
    _check_against_hf(tiny_llama, llm)


def test_chunked_prefill_and_forced_preemption(tiny_llama):
    # 30 blocks of 4 tokens = 120 slots for six sequences of 31 to 99 tokens
    llm = _llm(tiny_llama, block_size=4, num_kv_blocks=30, max_model_len=112,
               max_num_batched_tokens=5)
    _check_against_hf(tiny_llama, llm, params=SamplingParams(temperature=0, max_tokens=30))
    assert llm.engine.stats().num_preemptions > 0


def test_prefix_cache_hits_and_gives_the_same_tokens(tiny_llama):
    llm = _llm(tiny_llama, kv_cache_memory="8MiB")
    shared = PROMPTS[3] + " " + PROMPTS[1]
    first = _check_against_hf(tiny_llama, llm, [shared + " one"])
    second = _check_against_hf(tiny_llama, llm, [shared + " one", shared + " two and three"])
    assert first[0].metrics.num_cached_tokens == 0
    assert second[1].metrics.num_cached_tokens >= 16


def test_bfloat16_runs_and_mostly_agrees(tiny_llama):
    """bf16 on the GPU (what serving runs): not token-exact against float32, but close."""
    llm = _llm(tiny_llama, dtype="bfloat16", kv_cache_dtype="bfloat16", kv_cache_memory="8MiB")
    ids = [encode(tiny_llama, p) for p in PROMPTS]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16))
    same = sum(o.outputs[0].token_ids[:4] == hf_greedy(tiny_llama, i, 16)[:4]
               for i, o in zip(ids, outs))
    assert same >= len(ids) // 2  # the first tokens, before bf16 noise compounds
    assert_all_blocks_free(llm.engine)


def _completed(outs, max_tokens: int) -> list[list[int]]:
    """Each output's tokens, after checking that it ran to its length: a request whose
    sampling raised ends with finish reason "error" and no tokens, and two such runs would
    be "equal"."""
    for out in outs:
        assert out.error is None and out.outputs[0].finish_reason == "length", \
            (out.request_id, out.error)
        assert len(out.outputs[0].token_ids) == max_tokens
    return [o.outputs[0].token_ids for o in outs]


def test_sampling_with_a_seed_is_reproducible(tiny_llama):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=123, ignore_eos=True)
    a = _llm(tiny_llama, kv_cache_memory="8MiB").generate(PROMPTS[:3], params)
    b = _llm(tiny_llama, kv_cache_memory="8MiB").generate(PROMPTS[:3], params)
    assert _completed(a, 16) == _completed(b, 16)
    # unseeded rows draw from the sampler's shared generator, in one batch with seeded ones
    # and every per-row parameter (penalties, top-k, min-p, logprobs) on the device
    mixed = [params, SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True),
             SamplingParams(temperature=0.8, top_k=20, min_p=0.05, repetition_penalty=1.2,
                            presence_penalty=0.5, frequency_penalty=0.3, logprobs=3,
                            max_tokens=16, ignore_eos=True)]
    c = _llm(tiny_llama, kv_cache_memory="8MiB").generate(PROMPTS[:3], mixed)
    assert _completed(c, 16)[0] == _completed(a, 16)[0]
    assert len(c[2].outputs[0].logprobs) == 16


REPETITIVE = ("The file object is open. The file object is closed. The file object is "
              "open. The file object")


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_with_speculation_equals_plain_greedy(tiny_llama, tiny_near_draft, method):
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft":
        spec["draft_model"] = str(tiny_near_draft)
    llm = _llm(tiny_llama, speculative=spec, kv_cache_memory="8MiB", block_size=4)
    _check_against_hf(tiny_llama, llm, [REPETITIVE] + PROMPTS[:4],
                      SamplingParams(temperature=0, max_tokens=30))
    stats = llm.engine.stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_speculation_runs_on_the_device(tiny_llama, tiny_near_draft, method):
    """Rejection sampling on the device's probabilities with the CPU's generators: every
    request completes with its drafts verified (none dropped for an error), and a seed
    gives the same tokens twice."""
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft":
        spec["draft_model"] = str(tiny_near_draft)
    # a low temperature keeps the tiny model near its repetitive greedy text, where the
    # n-gram proposer finds matches; the rows are still sampled (rejection sampling)
    params = SamplingParams(temperature=0.1, max_tokens=24, seed=7, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = _llm(tiny_llama, speculative=spec, kv_cache_memory="8MiB", block_size=4)
        runs.append(_completed(llm.generate([REPETITIVE] + PROMPTS[:3], params), 24))
        stats = llm.engine.stats()
        assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0
        assert_all_blocks_free(llm.engine)
    assert runs[0] == runs[1]


def _int8(layer: int, kind: int, x: torch.Tensor) -> torch.Tensor:
    return dequantize_int8(*quantize_int8(x), x.dtype)


def test_int8_kv_equals_transformers_with_int8_kv(tiny_llama):
    reference = quantized_reference(tiny_llama, [encode(tiny_llama, p) for p in PROMPTS], 30,
                                    _int8)
    llm = _llm(tiny_llama, kv_cache_dtype="int8", kv_cache_memory="4MiB")
    assert llm.engine.target.kv_cache.dtype == torch.int8
    assert llm.engine.target.kv_scales.device.type == device_name()
    check(llm, reference, tiny_llama)
    # prefix-cache hits read another request's codes and scales
    again = check(llm, reference, tiny_llama, PROMPTS[3:4], max_tokens=20)
    assert again[0].metrics.num_cached_tokens >= 16


def test_fp8_kv_equals_transformers_with_the_same_scales(tiny_llama):
    """The scales are calibrated on the device at start; the CPU reference quantizes K/V
    with those same scales (an E4M3 step is 1/8 of a value: float noise between the
    devices could flip a code, which the widened logits absorb)."""
    llm = _llm(tiny_llama, kv_cache_dtype="fp8", kv_cache_memory="4MiB")
    target = llm.engine.target
    assert target.kv_cache.dtype == torch.uint8 and target.kv_scales.device.type == device_name()
    scales = target.kv_scales.cpu()

    def fp8(layer: int, kind: int, x: torch.Tensor) -> torch.Tensor:
        s = scales[layer, kind]
        return dequantize_fp8(quantize_fp8(x, s), s, x.dtype)

    reference = quantized_reference(tiny_llama, [encode(tiny_llama, p) for p in PROMPTS], 30, fp8)
    check(llm, reference, tiny_llama)


def test_fp8_kv_scales_calibrated_on_cuda_match_the_cpus(tiny_llama):
    """Calibration reads K/V absmax from a forward pass: the same windows on either device
    give the same scales up to float32 summation order (relative 1e-4)."""
    on_device = _llm(tiny_llama, kv_cache_dtype="fp8", kv_cache_memory="4MiB")
    on_cpu = LLM(str(tiny_llama), device="cpu", kv_cache_dtype="fp8", kv_cache_memory="4MiB")
    torch.testing.assert_close(on_device.engine.target.kv_scales.cpu(),
                               on_cpu.engine.target.kv_scales, rtol=1e-4, atol=1e-7)


@REAL_CUDA
def test_the_kv_cache_fraction_is_of_free_gpu_memory(tiny_llama):
    """kv_cache_memory as a fraction sizes the cache from torch.cuda.mem_get_info (taken
    after the weights load: the tiny model's weights are far below 5% of 0.1% of it)."""
    free, _ = torch.cuda.mem_get_info()
    # max_num_seqs high enough that the cap (every sequence at full length) does not bind
    llm = LLM(str(tiny_llama), device="cuda", kv_cache_memory=0.001, max_num_seqs=4096)
    plan = llm.engine.kv_plan
    assert plan.total_bytes == pytest.approx(0.001 * free, rel=0.05)
