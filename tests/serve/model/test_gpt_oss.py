"""gpt-oss on the engine, against transformers 5's ``GptOssForCausalLM`` in float32.

The model is the tiny random checkpoint of ``tests/data/families/gpt_oss.json``
(``tests.tiny.GPT_OSS_FAMILY_NAMES``): 3 layers (sliding, full, sliding; a window of
8 that every prompt here outgrows), 4 heads over 2 KV heads with q/k/v/o biases and
attention sinks, 4 experts top-2 (the router's top-k logits, then their softmax) with
biases and the clamped SwiGLU (limit 1.5 so that the clamps bite), YaRN RoPE (factor 4,
not truncated). Its biases and sinks are drawn at random (``tests.tiny.RANDOM_VECTORS``).
No EOS: both sides run every token.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from llmctl.errors import UnsupportedArchitectureError
from llmctl.models.spec import ModelArch
from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.llm import LLM
from llmctl.serve.model.scoring import teacher_forced_logits
from tests.serve.conftest import PROMPTS, assert_all_blocks_free, encode, hf_greedy, hf_model

NEW_TOKENS = 64
NAME = "gpt_oss"


def _greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _prompts(path) -> list[list[int]]:
    return [encode(path, p) for p in PROMPTS[:4]]


def _model(llm: LLM):
    return llm.engine.runner.model


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def _kernel_calls(llm: LLM, kernels: str = "on", which: str = "kernel") -> list[bool] | None:
    """Spy on the runner's native attention kernel (``which``: the paged ``kernel`` or the
    ``prefill`` one): per call, whether it was handed sinks (its last argument). None
    where the kernels are off, or not built (only without a C++ compiler, or switched off
    by ``LLMCTL_CPU_KERNELS=0``)."""
    from llmctl.serve.kernels import cpu as cpu_kernels

    runner = llm.engine.runner
    inner = getattr(runner, which)
    if kernels == "off":
        assert inner is None
        return None
    if inner is None:
        assert cpu_kernels._compiler() is None or not cpu_kernels.native_enabled()
        return None
    calls = []

    def spy(*args):
        calls.append(args[-1] is not None)
        return inner(*args)

    setattr(runner, which, spy)
    return calls


def _assert_kernel_ran_with_sinks(calls: list[bool] | None) -> None:
    assert calls is None or (calls and all(calls)), calls


# --- the config and the layer pieces -----------------------------------------------------
def test_config_reads_as_transformers_reads_it(tiny_family):
    """The tiny config, and a config.json that states nothing past model_type (read with
    GptOssConfig's defaults, as transformers reads it)."""
    from transformers import GptOssConfig

    arch = ModelArch.from_config(_config(tiny_family(NAME)))
    assert arch.layer_windows == (8, None, 8)
    assert arch.attn_sinks and arch.qkv_bias and arch.o_bias
    assert (arch.num_experts, arch.experts_per_token, arch.moe_layers) == (4, 2, (True,) * 3)
    assert (arch.expert_act, arch.swiglu_alpha, arch.swiglu_limit) == \
        ("clamped_swiglu", 1.702, 1.5)
    assert arch.rope["rope_type"] == "yarn" and arch.rope["truncate"] is False

    bare = ModelArch.from_config({"model_type": "gpt_oss"})
    ref = GptOssConfig()
    assert (bare.num_layers, bare.hidden_size, bare.head_dim, bare.num_heads,
            bare.num_kv_heads, bare.num_experts, bare.experts_per_token,
            bare.expert_intermediate_size, bare.vocab_size, bare.rms_norm_eps,
            bare.max_position_embeddings, bare.swiglu_alpha, bare.swiglu_limit) == (
        ref.num_hidden_layers, ref.hidden_size, ref.head_dim, ref.num_attention_heads,
        ref.num_key_value_heads, ref.num_local_experts, ref.num_experts_per_tok,
        ref.intermediate_size, ref.vocab_size, ref.rms_norm_eps,
        ref.max_position_embeddings, ref.swiglu_alpha, ref.swiglu_limit)
    assert bare.layer_windows == tuple(
        ref.sliding_window if t == "sliding_attention" else None for t in ref.layer_types)
    assert bare.qkv_bias and bare.o_bias and not bare.tie_word_embeddings
    rope = {k: v for k, v in bare.rope.items()}
    assert rope == {**ref.rope_parameters, "rope_theta": ref.rope_parameters["rope_theta"]}


def test_the_released_config_layout_reads():
    """config.json as openai/gpt-oss-20b ships it (transformers 4.55's writer: the old
    rope_scaling key, rope_theta beside it, no swiglu_alpha, an mxfp4
    quantization_config): transformers' numbers."""
    from transformers import GptOssConfig

    released = {
        "model_type": "gpt_oss", "attention_bias": True, "experts_per_token": 4,
        "head_dim": 64, "hidden_size": 2880, "intermediate_size": 2880,
        "initial_context_length": 4096, "layer_types": ["sliding_attention",
                                                        "full_attention"] * 12,
        "max_position_embeddings": 131072, "num_attention_heads": 64,
        "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
        "num_local_experts": 32, "rms_norm_eps": 1e-05, "rope_theta": 150000,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn",
                         "truncate": False},
        "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
        "vocab_size": 201088, "quantization_config": {"quant_method": "mxfp4"}}
    arch = ModelArch.from_config(released)
    ref = GptOssConfig(**{k: v for k, v in released.items()
                          if k not in ("model_type", "quantization_config")})
    assert arch.rope == {**ref.rope_parameters, "rope_theta": 150000}
    assert (arch.num_experts, arch.experts_per_token, arch.swiglu_alpha) == (32, 4, 1.702)
    assert arch.layer_windows == (128, None) * 12


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_equals_transformers(truncate):
    """llmctl's YaRN frequencies and attention factor: transformers'
    ``_compute_yarn_parameters`` for gpt-oss's RoPE (its own truncate=False, and True)."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from llmctl.models.layers.rope import RoPE, inv_freq

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": truncate, "original_max_position_embeddings": 4096}
    ref = GptOssConfig(rope_parameters=dict(rope))
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](ref)
    arch = ModelArch.from_config(ref.to_dict())
    got, factor = inv_freq(arch.rope, arch.head_dim, RoPE.of(arch).max_position_embeddings)
    assert torch.equal(got, want) and factor == want_factor


def test_clamped_swiglu_equals_transformers():
    """The experts' activation on values past the limit both ways: GptOssExperts'."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from llmctl.models.layers.moe import clamped_swiglu

    config = GptOssConfig(hidden_size=8, intermediate_size=8, num_local_experts=2,
                          swiglu_limit=1.5)
    gate_up = torch.randn(5, 16, generator=torch.Generator().manual_seed(0)) * 4
    want = GptOssExperts(config)._apply_gate(gate_up)
    assert torch.equal(clamped_swiglu(config.swiglu_alpha, config.swiglu_limit)(gate_up), want)
    assert (gate_up.abs() > 1.5).float().mean() > 0.3  # the clamps bite


def test_sink_attention_equals_transformers_eager():
    """Sinks in the engine's eager attention, with GQA and a causal mask, against
    transformers' ``eager_attention_forward`` of gpt-oss; and a sink moves the output."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from llmctl.serve.layers.attention import softcapped_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 6, 8, generator=gen) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=gen) * 2
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    additive = torch.zeros(6, 6).masked_fill(~causal, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=2, sinks=sinks, training=False)
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.3)
    got = softcapped_attention(q, k, v, causal, 0.3, None, sinks.view(1, 4, 1, 1))
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-6, rtol=1e-6)
    plain = softcapped_attention(q, k, v, causal, 0.3, None)
    assert (plain - got).abs().max() > 0.01


def test_sink_attention_in_query_slices_is_the_whole(monkeypatch):
    """A fresh prompt longer than the query slice, full and windowed, with sinks: the
    sliced attention equals the one-piece eager one."""
    from llmctl.serve.layers import attention

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 23, 8, generator=gen) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=gen)
    whole = [attention._causal_attention(q, k, v, 0.3, None, sinks),
             attention.windowed_causal_attention(q, k, v, 6, 0.3, None, sinks)]
    monkeypatch.setattr(attention, "WINDOW_QUERY_SLICE", 5)
    sliced = [attention._causal_attention(q, k, v, 0.3, None, sinks),
              attention.windowed_causal_attention(q, k, v, 6, 0.3, None, sinks)]
    for a, b in zip(whole, sliced):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


# --- the engine against transformers ----------------------------------------------------
@pytest.mark.parametrize("kernels", ["on", "off"])
def test_logits_equal_transformers(tiny_family, request, kernels):
    """A 20-token fresh prefill (past the window), then one token at a time through the
    paged cache: every position's logits within 1e-4 of transformers' (float32). Kernels
    on: every decode step's attention is the native paged kernel, handed the sinks."""
    if kernels == "off":
        request.getfixturevalue("kernels_off")
    path = tiny_family(NAME)
    ids = (encode(path, PROMPTS[3]) * 2)[:80]
    llm = LLM(str(path), kv_cache_memory="4MiB", block_size=4)
    calls = _kernel_calls(llm, kernels)
    assert _model(llm).decode_layers is None  # mixture-of-experts layers (decoder.py)
    got = teacher_forced_logits(llm.engine, ids, 20)
    _assert_kernel_ran_with_sinks(calls)
    with torch.inference_mode():
        want = hf_model(str(path))(torch.tensor([ids])).logits[0, 19:].float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernels", ["on", "off"])
def test_greedy_tokens_equal_transformers(tiny_family, request, routed, kernels):
    """64 new tokens for a batch of four prompts at once, equal to ``generate``'s, with
    the batch's rows routed to different experts in the same step; then the same prompts
    again: prefix-cache hits, the same tokens."""
    if kernels == "off":
        request.getfixturevalue("kernels_off")
    path = tiny_family(NAME)
    ids = _prompts(path)
    want = [hf_greedy(path, p, NEW_TOKENS) for p in ids]
    llm = LLM(str(path), kv_cache_memory="8MiB", block_size=4)
    calls = _kernel_calls(llm, kernels)
    for _ in range(2):
        outs = llm.generate(ids, _greedy())
        assert [o.outputs[0].token_ids for o in outs] == want
    _assert_kernel_ran_with_sinks(calls)
    assert llm.engine.stats().prefix_cache_hit_tokens > 0
    assert_all_blocks_free(llm.engine)
    mixed = [c for c in routed if len(c) > 1 and len(set(c)) > 1]
    assert len(mixed) > NEW_TOKENS
    assert set().union(*(s for c in routed for s in c)) == set(range(4))


def test_chunked_prefill_and_speculation_keep_the_tokens(tiny_family):
    """Prompt chunks of 5 tokens (later chunks attend through the native paged kernel,
    several queries per sequence, sinks and windows included), and n-gram drafts verified
    several tokens at a time."""
    path = tiny_family(NAME)
    ids = _prompts(path)
    want = [hf_greedy(path, p, NEW_TOKENS) for p in ids]
    chunked = LLM(str(path), kv_cache_memory="8MiB", block_size=4, max_num_batched_tokens=5)
    calls = _kernel_calls(chunked, "on")
    assert [o.outputs[0].token_ids for o in chunked.generate(ids, _greedy())] == want
    _assert_kernel_ran_with_sinks(calls)
    spec = LLM(str(path), kv_cache_memory="8MiB", block_size=4,
               speculative={"method": "ngram", "num_speculative_tokens": 3})
    calls = _kernel_calls(spec, "on")
    assert [o.outputs[0].token_ids for o in spec.generate(ids[2:], _greedy())] == want[2:]
    _assert_kernel_ran_with_sinks(calls)


def test_bfloat16_stays_close(tiny_family):
    """bf16 weights, activations and cache, attention on the native kernel: the median
    over positions of the largest logit error at most twice transformers' own bf16 one
    plus 0.1 (test_moe.py's bound)."""
    from llmctl.models.loading import load_model

    path = tiny_family(NAME)
    ids = encode(path, PROMPTS[3])
    llm = LLM(str(path), kv_cache_memory="4MiB", block_size=4, dtype="bfloat16")
    calls = _kernel_calls(llm, "on")
    got = teacher_forced_logits(llm.engine, ids, 12)
    _assert_kernel_ran_with_sinks(calls)
    with torch.inference_mode():
        want = hf_model(str(path))(torch.tensor([ids])).logits[0, 11:].float()
        hf_bf16 = load_model(path, "bfloat16")(torch.tensor([ids])).logits[0, 11:].float()
    ours = (got - want).abs().amax(-1).median().item()
    theirs = (hf_bf16 - want).abs().amax(-1).median().item()
    assert ours <= 2 * theirs + 0.1, (ours, theirs)


@pytest.fixture(scope="module")
def wide_heads(tiny_variants):
    """The tiny gpt-oss with heads of 64: the size the kernels' vector bodies take."""
    from tests.tiny import FAMILY_CONFIGS

    config = json.loads((FAMILY_CONFIGS / f"{NAME}.json").read_text()) | {"head_dim": 64}
    return tiny_variants("gpt_oss_d64", layers=config.pop("num_hidden_layers"), **config)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_vector_kernel_bodies_compute_the_sinks(wide_heads, dtype):
    """Heads of 64 in blocks of 16: decode steps on the paged kernel's vector bodies
    (float32 AVX-512 or AVX2; bf16 AVX512-BF16) and, bf16 where built, the fresh prompt on
    the prefill kernel, sinks handed to each. float32: logits within 1e-4 of
    transformers'; bf16: test_bfloat16_stays_close's bound."""
    from llmctl.models.loading import load_model
    from llmctl.utils.cpu import cpu_flags

    ids = (encode(wide_heads, PROMPTS[3]) * 2)[:80]
    llm = LLM(str(wide_heads), kv_cache_memory="8MiB", block_size=16, dtype=dtype)
    calls = _kernel_calls(llm)
    # the prefill kernel: bf16 where the build has AVX512-BF16 (only a CPU without it lacks it)
    runner, prefills = llm.engine.runner, None
    if dtype == "bfloat16" and (runner.prefill is not None or "avx512_bf16" in cpu_flags()):
        prefills = _kernel_calls(llm, which="prefill")
    got = teacher_forced_logits(llm.engine, ids, 20)
    _assert_kernel_ran_with_sinks(calls)
    _assert_kernel_ran_with_sinks(prefills)
    with torch.inference_mode():
        want = hf_model(str(wide_heads))(torch.tensor([ids])).logits[0, 19:].float()
        if dtype == "float32":
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            return
        hf_bf16 = load_model(wide_heads, "bfloat16")(torch.tensor([ids])).logits[0, 19:].float()
    ours = (got - want).abs().amax(-1).median().item()
    theirs = (hf_bf16 - want).abs().amax(-1).median().item()
    assert ours <= 2 * theirs + 0.1, (ours, theirs)


def test_int8_kv_cache_stays_close(tiny_family):
    """float32 weights over an int8 cache (read in place by the native kernel, sinks
    included) against the float32 reference: test_moe.py's bounds on the typical position
    (the cache's rounding can tip a router near-tie)."""
    path = tiny_family(NAME)
    ids = encode(path, PROMPTS[3])
    llm = LLM(str(path), kv_cache_memory="4MiB", block_size=4, kv_cache_dtype="int8")
    calls = _kernel_calls(llm, "on")
    got = teacher_forced_logits(llm.engine, ids, 12)
    _assert_kernel_ran_with_sinks(calls)
    with torch.inference_mode():
        want = hf_model(str(path))(torch.tensor([ids])).logits[0, 11:].float()
    assert (got - want).abs().amax(-1).median() < 0.2
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85


# --- MXFP4 experts -----------------------------------------------------------------------
def _mxfp4_checkpoint(path, out):
    """``path``'s checkpoint with every expert stored as gpt-oss ships them: MXFP4
    ``_blocks`` / ``_scales`` of the F.linear layout ``[E, out, in]`` (llmctl's encoder),
    biases as they are, ``quantization_config: mxfp4``. Returns the blocks and scales."""
    from safetensors.torch import load_file, save_file

    from llmctl.quant import mxfp4

    shutil.copytree(path, out)
    weights = load_file(str(out / "model.safetensors"))
    packed = {}
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj",
                                                   "experts.down_proj"))]:
        blocks, scales = mxfp4.quantize(weights.pop(name).transpose(1, 2))
        weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks, scales
        packed[name] = (blocks, scales)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = _config(out)
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return packed


def test_mxfp4_experts_equal_transformers_on_the_dequantized_weights(tiny_family, tmp_path):
    """The MXFP4 checkpoint on the engine, decoded at load (quant_backend "dequantize";
    the 4-bit kernel path: tests/serve/model/test_moe_lowbit_experts.py): its logits
    within 1e-4 of transformers' model whose experts are ``convert_moe_packed_tensors`` of
    the same blocks and scales; and the quantization moved them (it is not the float
    checkpoint by another name)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from llmctl.models.loading import load_model

    path = tiny_family(NAME)
    packed = _mxfp4_checkpoint(path, tmp_path / "mxfp4")
    ids = (encode(path, PROMPTS[1]) * 4)[:40]
    got = teacher_forced_logits(LLM(str(tmp_path / "mxfp4"), kv_cache_memory="4MiB",
                                    block_size=4, quant_backend="dequantize").engine, ids, 10)
    reference = load_model(path, "float32")
    with torch.no_grad():
        params = dict(reference.named_parameters())
        for name, (blocks, scales) in packed.items():
            params[name].copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
        want = reference(torch.tensor([ids])).logits[0, 9:].float()
        float_logits = hf_model(str(path))(torch.tensor([ids])).logits[0, 9:].float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (float_logits - want).abs().max() > 1e-2


def test_mxfp4_on_another_family_is_refused(tiny_family, tmp_path):
    from llmctl.serve.model.weights import load_model

    path = tiny_family("qwen3_moe")
    out = tmp_path / "q3"
    shutil.copytree(path, out)
    config = _config(out) | {"quantization_config": {"quant_method": "mxfp4"}}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="MXFP4 experts of gpt-oss"):
        load_model(out, dtype=torch.float32, device=torch.device("cpu"), backend="kernel",
                   max_len=64)


# --- what refuses it ---------------------------------------------------------------------
def test_commands_past_the_engine_refuse_it_in_one_line(tiny_family):
    """The importance matrix and the build targets stop before any work, naming the command
    and what it takes (quantize and GGUF export take it: tests/quant/test_gpt_oss_quant.py,
    tests/gguf/test_moe_export.py)."""
    from llmctl.engines.targets import get_target
    from llmctl.models.architectures import get_architecture

    with pytest.raises(UnsupportedArchitectureError,
                       match="the importance matrix does not handle mixture-of-experts") as err:
        get_architecture("gpt_oss", refuse_moe="the importance matrix")
    assert "\n" not in str(err.value)
    for target in ("torch-compile", "onnx", "tensorrt-llm"):
        with pytest.raises(UnsupportedArchitectureError, match=f"the {target} target does"):
            get_target(target).check_source(SimpleNamespace(model_type=NAME, config={}))
    assert get_architecture("gpt_oss").causal_lm_class == "GptOssForCausalLM"


# (compressed-tensors quantization takes it per expert: tests/quant/test_gpt_oss_quant.py)
@pytest.mark.parametrize("args, reason", [
    # GGUF export takes gpt-oss; this tiny config is one llama.cpp's graph cannot run
    # (swiglu_limit 1.5, YaRN not truncated): refused naming the fields
    (["--format", "gguf", "--type", "Q8_0", "--dry-run"], "swiglu_limit at 7.0"),
])
def test_llmctl_quantize_refuses_it_in_one_line(tiny_family, args, reason):
    """``llmctl quantize --format gguf`` of what llama.cpp cannot compute stops before
    any work."""
    from typer.testing import CliRunner

    from llmctl.cli.app import build_app

    result = CliRunner().invoke(build_app(), ["quantize", str(tiny_family(NAME)), *args])
    assert result.exit_code != 0
    assert reason in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output


def test_a_kernel_group_hands_the_kernel_its_sinks():
    """A kernel group of a layer with sinks passes them to the native kernel (the kernel
    tests, tests/serve/kernels/test_attention_sinks.py, check what it computes)."""
    from llmctl.serve.layers.attention import AttnGroup, AttnMetadata, paged_attention

    sinks, seen = torch.zeros(4), []
    group = AttnGroup(start=0, end=1, num_seqs=1, q_len=1, fresh=False,
                      context_lens=torch.tensor([1]))
    meta = AttnMetadata(slot_mapping=torch.tensor([0]), groups=[group],
                        kernel=lambda *a: seen.append(a[9]) or torch.zeros(1, 32))
    q, kv = torch.zeros(1, 4, 8), torch.zeros(1, 2, 8)
    paged_attention(q, kv, kv, torch.zeros(2, 1, 4, 2, 8), meta, 1.0, sinks=sinks)
    assert len(seen) == 1 and seen[0] is sinks
