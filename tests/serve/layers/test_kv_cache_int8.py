"""The int8 KV cache (:mod:`llmctl.serve.layers.kv_quant`): its maths, the native kernels against
the torch path, the engine against transformers with K/V quantized the same way (float32:
greedy tokens exact) under batching, prefix-cache hits, preemption and forks, the block
accounting, the command line, and SmolLM2's quality against a bf16 cache."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from llmctl.serve.engine.llm import LLM
from llmctl.serve.kernels import cpu as cpu_kernels
from llmctl.serve.layers.kv_quant import dequantize_int8, quantize_int8
from llmctl.utils.cpu import cpu_flags
from tests.serve.conftest import PROMPTS, encode
from tests.serve.kv_quant_engine import (
    check,
    check_fused_decode_layers_bit_for_bit,
    check_prefix_hits_preemption_and_forks,
    prefill_logit_shift,
    quantized_reference,
)
from tests.serve.paged_cases import CASES, assert_8bit_kernel_reads_like_torch, random_case

CPU = torch.device("cpu")
needs_kernels = pytest.mark.skipif(
    cpu_kernels.paged_attention_kernel(CPU, torch.float32, codes=torch.int8) is None,
    reason="no C++ compiler: the native kernels are not built here")


def test_codes_scales_and_the_error_bound():
    gen = torch.Generator().manual_seed(0)
    # magnitudes over five decades, and an all-zero head
    x = torch.randn(50, 3, 64, generator=gen) * torch.logspace(-3, 2, 50)[:, None, None]
    x[7, 1] = 0
    codes, scales = quantize_int8(x)
    assert codes.dtype == torch.int8 and scales.shape == (50, 3)
    live = scales > 0
    assert live.sum() == 50 * 3 - 1 and not codes[7, 1].any()
    assert (codes.abs().amax(-1)[live] == 127).all()  # each head's absmax maps to +-127
    err = (dequantize_int8(codes, scales, torch.float32) - x).abs()
    assert (err <= scales.unsqueeze(-1) * 0.5001).all()  # half a quantization step


@needs_kernels
@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("q_len", [1, 20])
@pytest.mark.parametrize("case", sorted(CASES))
def test_native_kernel_reads_int8_like_the_torch_path(case, q_len, dtype, window, isa):
    """The kernel on codes + scales against the torch fallback (gather the blocks,
    dequantize them, SDPA), over shuffled block tables and contexts on and off tile and
    block edges."""
    heads, kv_heads, d, block_size = CASES[case]
    contexts = [q_len + extra for extra in (0, 5, 15, 16, 31, 33, 200)]
    values, tables, q, num_blocks = random_case(
        heads=heads, kv_heads=kv_heads, head_dim=d, block_size=block_size,
        contexts=contexts, q_len=q_len, dtype=dtype, seed=q_len)
    # per-token magnitudes that differ a lot: scales matter
    gen = torch.Generator().manual_seed(q_len)
    values = values.float() * torch.rand(*values.shape[:-1], 1, generator=gen) * 4
    codes, scales = quantize_int8(values)
    assert_8bit_kernel_reads_like_torch(case, codes, scales, tables, q, contexts=contexts,
                                        q_len=q_len, window=window, num_blocks=num_blocks)


@needs_kernels
@pytest.mark.parametrize("tokens", [3, 100])  # 100: the multi-threaded branch
def test_fused_rope_and_int8_cache_write_quantize_like_kv_quant(tokens):
    """csrc/rope_kv.cpp's int8 write: codes and scales equal to quantize_int8 of the
    rotated bf16 keys and of the values, at exactly the given slots."""
    from llmctl.serve.layers.rope import rope_freqs, rope_parameters

    nh, nkv, d, block = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(tokens)
    freqs = rope_freqs(rope_parameters({"rope_theta": 10000.0}), d, 2048, 512)
    kernel = cpu_kernels.rope_kv_kernel(CPU, torch.bfloat16, freqs)
    qkv = (torch.randn(tokens, (nh + 2 * nkv) * d, generator=gen) * 3).bfloat16()
    qk = qkv[:, :(nh + nkv) * d].view(tokens, nh + nkv, d)
    v = qkv[:, (nh + nkv) * d:].view(tokens, nkv, d)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    slots = torch.randperm(40 * block, generator=gen)[:tokens]
    cache = torch.full((2, 40, block, nkv, d), 5, dtype=torch.int8)
    scales = torch.full((2, 40, block, nkv), -1.0)
    kernel(qk, v, positions, slots, cache, scales)
    written = torch.zeros(40 * block, dtype=torch.bool)
    written[slots] = True
    for i, x in enumerate((qk[:, nh:], v)):
        codes, s = quantize_int8(x)
        assert torch.equal(cache[i].view(-1, nkv, d)[slots], codes)
        assert torch.equal(scales[i].view(-1, nkv)[slots], s)
        assert (cache[i].view(-1, nkv, d)[~written] == 5).all()
        assert (scales[i].view(-1, nkv)[~written] == -1).all()


# -- the engine against transformers with the same quantization -----------------------


def _int8(layer: int, kind: int, x: torch.Tensor) -> torch.Tensor:
    """Each token's K/V quantized once per head, from its own values, as the engine does."""
    return dequantize_int8(*quantize_int8(x), x.dtype)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Greedy continuations of PROMPTS under int8 K/V, 30 tokens (computed once)."""
    return quantized_reference(tiny_llama, [encode(tiny_llama, p) for p in PROMPTS], 30, _int8)


@pytest.mark.parametrize("native", [True, False], ids=["kernels", "torch"])
def test_greedy_equals_transformers_with_int8_kv(tiny_llama, reference, native, request):
    if not native:
        request.getfixturevalue("kernels_off")
    llm = LLM(str(tiny_llama), kv_cache_dtype="int8", kv_cache_memory="4MiB")
    assert (llm.engine.runner.kernel is not None) == native
    check(llm, reference, tiny_llama)


def test_prefix_cache_hits_preemption_and_forks_keep_the_tokens(tiny_llama, reference):
    check_prefix_hits_preemption_and_forks(tiny_llama, reference, "int8")


def test_prefill_sees_the_cache_decode_sees_and_logits_stay_close(tiny_llama):
    """int8 moves the logits of this model by at most 0.25 (measured: 0.10; its logits
    span ~+-6)."""
    assert 1e-3 < prefill_logit_shift(tiny_llama, "int8") < 0.25


@pytest.mark.skipif(not {"avx512_bf16", "avx512_vnni"} <= cpu_flags(),
                    reason="the fused decode layer needs AVX512-BF16 and AVX512-VNNI")
def test_fused_decode_layers_read_int8_bit_for_bit_like_the_layer_loop(tiny_llama):
    check_fused_decode_layers_bit_for_bit(tiny_llama, "int8")


# -- memory, configuration, command line ---------------------------------------------


def test_int8_holds_nearly_twice_the_blocks_of_bf16_scales_counted(tiny_llama):
    from llmctl.serve.model.kv_cache import plan_kv_cache

    smollm2 = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16,
                   budget="256MiB", max_num_seqs=1000, max_model_len=2048)
    bf16 = plan_kv_cache(itemsize=2, **smollm2)
    int8 = plan_kv_cache(itemsize=1, scale_bytes=4, **smollm2)
    # per block: 30 layers x K,V x 16 tokens x 3 heads x (64 values + one float32 scale)
    assert int8.bytes_per_block == 30 * 2 * 16 * 3 * 68
    assert int8.num_blocks == 256 * 2**20 // int8.bytes_per_block
    assert int8.num_blocks / bf16.num_blocks == pytest.approx(128 / 68, rel=1e-3)
    engine = LLM(str(tiny_llama), dtype="bfloat16", kv_cache_dtype="int8",
                 kv_cache_memory="1MiB").engine
    # tiny_llama: 2 layers, 2 KV heads of 16: (16 + 4) bytes per token and head
    assert engine.stats().kv_cache_blocks == 2**20 // (2 * 2 * 16 * 2 * 20)
    assert engine.kv_plan.describe().startswith("KV cache (int8, a float32 scale")
    assert engine.runner.kv_scales.shape == (2, 2, engine.kv_plan.num_blocks, 16, 2)


def _usage_error(args: list[str], option: str, *expected: str) -> None:
    from llmctl.cli.app import build_app

    result = CliRunner().invoke(build_app(), args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 2 and lines[0].startswith("error: ") and option in lines[0], lines
    assert all(text in lines[0] for text in expected), lines


@pytest.mark.parametrize("args,option,expected", [
    (["eval", "m", "--kv-cache-dtype", "int4"], "--kv-cache-dtype", ["'int8'"]),
    (["eval", "m", "--kv-cache-dtype", "int8"], "--kv-cache-dtype", ["--backend serve"]),
    (["serve", "m", "--engine", "vllm", "--kv-cache-dtype", "int8"], "--kv-cache-dtype",
     ["vllm"]),
])
def test_command_line_refuses_what_it_does_not_do(args, option, expected):
    _usage_error(args, option, *expected)


def test_engine_directories_and_the_config_refuse_other_kv_dtypes(tmp_path):
    from llmctl.engines.serve_engine import engine_dir_settings
    from llmctl.errors import ConfigError, UsageError
    from llmctl.serve.engine.config import make_engine_config

    with pytest.raises(UsageError, match="--kv-cache-dtype"):
        engine_dir_settings(tmp_path, {"kv_cache_dtype": "int8"})
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        make_engine_config("m", kv_cache_dtype="fp8_e5m2")


# -- quality on a real model -----------------------------------------------------------


def test_smollm2_int8_kv_against_bf16_kv_through_llmctl_eval(smollm2, tmp_path):
    """``llmctl eval --backend serve --kv-cache-dtype int8``: SmolLM2 in bf16 with an int8
    cache against the same engine with its bf16 cache, on held-out text. Target mean KLD
    <= 0.01 (measured 0.0028 on 4 windows of 512, same top-1 97%); two short windows here."""
    from llmctl.eval.runner import EvalConfig, run_eval
    from llmctl.eval.windows import Windowing

    config = EvalConfig(candidate=str(smollm2), reference=str(smollm2), backend="serve",
                        dtype="bfloat16", kv_cache_dtype="int8", cache_dir=tmp_path,
                        windowing=Windowing(ctx=192, max_windows=2))
    report = run_eval(config)
    metrics = report["metrics"]
    assert report["metadata"]["candidate"]["kv_cache"].startswith("int8")
    assert report["metadata"]["reference"]["kv_cache"] == "bfloat16"
    assert 0 < metrics["mean_kld"] <= 0.01  # > 0: the candidate's cache really is int8
    assert metrics["same_top_p"] >= 0.9
