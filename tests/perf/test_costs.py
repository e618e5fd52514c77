"""FLOPs, parameters and bytes against hand-computed values on tiny configs, and against
the published sizes of Llama 3 8B / 70B and Mixtral 8x7B."""

import math

import pytest

from llmctl.errors import ConfigError, UnsupportedArchitectureError
from llmctl.perf.arch import ArchSpec
from llmctl.perf.costs import ModelCost
from llmctl.perf.weight_format import WeightFormat


def tiny(**over) -> dict:
    """hidden 64, 2 layers, 4 heads of 16, MLP 128, vocab 1000, tied."""
    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128,
           "vocab_size": 1000, "tie_word_embeddings": True}
    return {**cfg, **over}


# Per layer: q, k, v, o 64x64 = 4 x 4096 (MHA); GQA with 2 KV heads: k, v 32x64 = 2048 each.
# MLP 3 x 64 x 128 = 24576. lm_head 1000 x 64 = 64000. Norms 2 x 64 per layer + 64 final.
MHA_LAYER, GQA_LAYER, HEAD, NORMS = 16384 + 24576, 12288 + 24576, 64000, 2 * 2 * 64 + 64
PER_KEY = 4 * 2 * 4 * 16  # 4 * layers * q_heads * head_dim


def test_parameters_of_mha_and_gqa():
    mha = ModelCost(ArchSpec.from_config(tiny()))
    gqa = ModelCost(ArchSpec.from_config(tiny(num_key_value_heads=2)))
    assert mha.matmul_params == 2 * MHA_LAYER + HEAD == 145920
    assert gqa.matmul_params == 2 * GQA_LAYER + HEAD == 137728
    assert mha.active_params == mha.matmul_params
    assert mha.total_params == 145920 + NORMS  # tied: the table is the lm_head
    untied = ModelCost(ArchSpec.from_config(tiny(tie_word_embeddings=False)))
    assert untied.total_params == 145920 + 64000 + NORMS


def test_flops_per_token_prefill_and_decode():
    m = ModelCost(ArchSpec.from_config(tiny()))
    assert m.flops_per_token(10) == 2 * 145920 + PER_KEY * 10 == 296960
    # 4 prompt tokens attend 1 + 2 + 3 + 4 = 10 keys; the lm_head runs once
    body = 2 * (145920 - HEAD)
    assert m.prefill_flops(4) == 4 * body + PER_KEY * 10 + 2 * HEAD == 788480
    # positions 2 and 3 after a cached prefix of 2: 3 + 4 keys
    assert m.prefill_flops(4, cached=2) == 2 * body + PER_KEY * 7 + 2 * HEAD == 459264
    assert m.decode_step_flops([3, 5]) == 2 * 2 * 145920 + PER_KEY * 8 == 587776
    with pytest.raises(ValueError, match="cached < prompt_len"):
        m.prefill_flops(4, cached=4)


def test_bytes_tied_untied_and_kv():
    tied = ModelCost(ArchSpec.from_config(tiny()))
    untied = ModelCost(ArchSpec.from_config(tiny(tie_word_embeddings=False)))
    assert tied.weight_bytes == (2 * MHA_LAYER + HEAD + NORMS) * 2 == 292480
    assert untied.weight_bytes == 292480 + HEAD * 2
    # decode reads the matmul weights, not the table (its looked-up rows are left out)
    assert tied.weight_bytes_read_per_step == untied.weight_bytes_read_per_step == 291840
    assert tied.kv_bytes_per_token == 2 * 2 * 4 * 16 * 2 == 512
    gqa = ModelCost(ArchSpec.from_config(tiny(num_key_value_heads=2)), kv_bytes=1.0)
    assert gqa.kv_bytes_per_token == 2 * 2 * 2 * 16 * 1 == 128
    assert tied.decode_step_bytes([3, 5]) == 291840 + 8 * 512
    assert tied.prefill_bytes(4, cached=1) == 291840 + 4 * 512


def test_int4_group_scales_and_zero_points_are_counted():
    w4 = WeightFormat.from_name("w4a16")
    assert w4.bits_per_weight() == 4 + 16 / 128 == 4.125
    assert w4.quantizes("model.layers.0.mlp.up_proj") and not w4.quantizes("lm_head")
    g32 = WeightFormat.from_name("w4a16-g32")
    arch = ArchSpec.from_config(tiny(num_key_value_heads=2))
    m = ModelCost(arch, g32)
    # linears at 4 + 16/32 = 4.5 bits; the tied head/table and the norms at 16 bits
    assert m.weight_bytes == 2 * GQA_LAYER * 4.5 / 8 + HEAD * 2 + NORMS * 2 == 170112
    assert m.weight_bytes_read_per_step == 2 * GQA_LAYER * 4.5 / 8 + HEAD * 2
    asym = WeightFormat.from_quant_config({"quant_method": "gptq", "bits": 4, "group_size": 32,
                                           "sym": False})
    assert asym.bits_per_weight() == 4 + (16 + 4) / 32
    assert ModelCost(arch, asym).weight_bytes == 2 * GQA_LAYER * 4.625 / 8 + 128000 + 640
    # a group that does not divide the row: ceil(64 / 48) = 2 scales per 64 weights
    g48 = WeightFormat.from_name("w4a16-g48")
    assert g48.bits_per_weight(64) == 4 + 2 * 16 / 64
    assert g48.bits_per_weight(128) == 4 + 3 * 16 / 128
    # per-channel 8-bit: one 16-bit scale per row of in_features
    assert WeightFormat.from_name("fp8").bits_per_weight(64) == 8 + 16 / 64


def test_an_unquantized_format_has_no_scales():
    bf16 = WeightFormat.from_name("bf16")
    assert not bf16.quantizes("model.layers.0.mlp.up_proj")
    assert bf16.bits_per_weight() == 16
    assert WeightFormat.from_name("fp32").bits_per_weight() == 32


SMOL_W4 = {  # what `llmctl quantize` wrote for SmolLM2 (llmctl-quant.json's config)
    "config_groups": {"group_0": {
        "format": "pack-quantized", "input_activations": None, "output_activations": None,
        "targets": ["Linear"],
        "weights": {"dynamic": False, "group_size": 64, "num_bits": 4, "strategy": "group",
                    "symmetric": True, "type": "int"}}},
    "format": "pack-quantized", "ignore": ["lm_head"], "quant_method": "compressed-tensors",
    "quantization_status": "compressed"}


def test_compressed_tensors_config():
    smol = {**tiny(), "quantization_config": SMOL_W4}
    assert ModelCost.from_config(smol).weights.name == "w4a16-g64"
    assert ModelCost.from_config(tiny()).weights.name == "bf16"
    fmt = WeightFormat.from_quant_config(SMOL_W4)
    assert fmt.name == "w4a16-g64" and fmt.compute_dtype == "bf16"
    assert fmt.bits_per_weight() == 4.25
    assert not fmt.quantizes("lm_head") and fmt.quantizes("model.layers.3.self_attn.q_proj")
    head_too = WeightFormat.from_quant_config({**SMOL_W4, "ignore": []})
    assert head_too.quantizes("lm_head")
    # a regex ignore keeps layer 0 in 16 bits: 1 of the 2 tiny layers
    first = WeightFormat.from_quant_config({**SMOL_W4, "ignore": ["lm_head",
                                                                  r"re:model\.layers\.0\..*"]})
    arch = ArchSpec.from_config(tiny())
    assert ModelCost(arch, first).weight_bytes == (
        MHA_LAYER * 2 + MHA_LAYER * 4.25 / 8 + HEAD * 2 + NORMS * 2)
    # the tied model with a quantized head: the float table stays for the lookup
    assert ModelCost(arch, head_too).weight_bytes == (
        (2 * MHA_LAYER + HEAD) * 4.25 / 8 + HEAD * 2 + NORMS * 2)
    fp8 = WeightFormat.from_quant_config({"config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                           "symmetric": True},
        "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}},
        "ignore": ["lm_head"], "quant_method": "compressed-tensors"})
    assert fp8.name == "fp8" and fp8.compute_dtype == "fp8"
    awq = WeightFormat.from_quant_config({"quant_method": "awq", "bits": 4, "group_size": 128,
                                          "zero_point": True})
    assert not awq.symmetric and awq.bits_per_weight() == 4 + 20 / 128


def test_format_errors_name_the_problem():
    with pytest.raises(ConfigError, match="unknown weight format 'w3'") as err:
        WeightFormat.from_name("w3")
    assert "w4a16" in err.value.remedy
    with pytest.raises(ConfigError, match="bad group suffix"):
        WeightFormat.from_name("bf16-g64")
    with pytest.raises(ConfigError, match="quant_method 'bitsandbytes'"):
        WeightFormat.from_quant_config({"quant_method": "bitsandbytes"})
    mixed = {"quant_method": "compressed-tensors", "config_groups": {
        "a": {"targets": ["re:.*mlp.*"], "weights": {"num_bits": 4, "strategy": "group",
                                                    "group_size": 128}},
        "b": {"targets": ["re:.*attn.*"], "weights": {"num_bits": 8, "strategy": "channel"}}}}
    with pytest.raises(ConfigError, match="mixes schemes"):
        WeightFormat.from_quant_config(mixed)
    nvfp4 = {"quant_method": "compressed-tensors", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
        "input_activations": {"num_bits": 4, "type": "float"}}}}
    with pytest.raises(ConfigError, match="4-bit activations"):
        WeightFormat.from_quant_config(nvfp4)


def test_mixture_of_experts_by_hand():
    cfg = tiny(model_type="mixtral", num_key_value_heads=2, intermediate_size=32,
               num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    m = ModelCost(ArchSpec.from_config(cfg))
    expert = 3 * 64 * 32  # 6144
    attn_router = 12288 + 64 * 4
    assert m.matmul_params == 2 * (attn_router + 4 * expert) + HEAD == 138240
    assert m.active_params == 2 * (attn_router + 2 * expert) + HEAD == 113664
    assert m.flops_per_token(1) == 2 * 113664 + PER_KEY
    # one token touches its 2 experts; two tokens 4 * (1 - 1/4) = 3 on average
    assert m.experts_touched(1) == 2 and m.experts_touched(2) == 3
    assert m.weight_bytes_read(1) == (2 * attn_router + 2 * 2 * expert + HEAD) * 2 == 227328
    assert m.weight_bytes == (2 * (attn_router + 4 * expert) + 2 * HEAD + NORMS) * 2
    qwen = tiny(model_type="qwen2_moe", num_key_value_heads=2, num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32, shared_expert_intermediate_size=16)
    q = ModelCost(ArchSpec.from_config(qwen))
    shared = 3 * 64 * 16 + 64  # the shared expert and its 1-output gate
    assert q.active_params == 2 * (attn_router + 2 * expert + shared) + HEAD


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="no 'intermediate_size'"):
        ArchSpec.from_config({k: v for k, v in tiny().items() if k != "intermediate_size"})
    with pytest.raises(UnsupportedArchitectureError, match="model type 'gpt2'.*gemma2.*"
                       "docs/architecture.md"):
        ArchSpec.from_config(tiny(model_type="gpt2"))
    with pytest.raises(ConfigError, match="no 'model_type'"):
        ArchSpec.from_config({k: v for k, v in tiny().items() if k != "model_type"})
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        ArchSpec.from_config(tiny(kv_lora_rank=512))
    with pytest.raises(ConfigError, match="'num_local_experts' on a llama model"):
        ArchSpec.from_config(tiny(num_local_experts=8))


def test_dense_layers_of_a_mixture_of_experts_are_costed_as_dense():
    """Qwen2/3-MoE's mlp_only_layers / decoder_sparse_step: each layer's own MLP, counted
    by hand (2 layers, hidden 64, the tiny() attention; experts 4 x (3 x 64 x 32), k = 2)."""
    moe = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "intermediate_size": 128}
    mixed = ModelCost(ArchSpec.from_config(tiny(**moe, mlp_only_layers=[0])))
    sparse = ModelCost(ArchSpec.from_config(tiny(**moe)))
    assert mixed.arch.moe_layers == (False, True) and sparse.arch.moe_layers == ()
    assert [mixed.arch.layer_is_moe(i) for i in range(2)] == [False, True]
    dense_mlp, experts, router = 3 * 64 * 128, 4 * 3 * 64 * 32, 4 * 64
    assert mixed.matmul_params - sparse.matmul_params == dense_mlp - experts - router
    assert mixed.active_params - sparse.active_params == dense_mlp - experts // 2 - router
    step = ArchSpec.from_config(tiny(**moe, decoder_sparse_step=2))  # layers i with (i+1) % 2
    assert step.moe_layers == (False, True)


def test_defaults_absent_from_a_diffed_config():
    # transformers omits values equal to the class default: Gemma ties and has head_dim 256
    gemma = ArchSpec.from_config({"model_type": "gemma", "hidden_size": 3072,
                                  "num_hidden_layers": 28, "num_attention_heads": 16,
                                  "intermediate_size": 24576, "vocab_size": 256000})
    assert gemma.tie_word_embeddings and gemma.head_dim == 256
    llama = ArchSpec.from_config(tiny(tie_word_embeddings=None) | {"tie_word_embeddings": False})
    assert not llama.tie_word_embeddings
    nested = ArchSpec.from_config({"model_type": "x", "text_config": tiny()})
    assert nested.hidden_size == 64
    qwen2 = ArchSpec.from_config(tiny(model_type="qwen2"))  # q/k/v biases
    assert qwen2.vector_params_per_layer() == 2 * 64 + 3 * 64


# Llama 3 configs as published (meta-llama/Meta-Llama-3-8B and -70B config.json).
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
             "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "tie_word_embeddings": False,
             "max_position_embeddings": 8192, "rope_theta": 500000.0, "torch_dtype": "bfloat16"}
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672,
              "num_attention_heads": 64, "num_hidden_layers": 80}


@pytest.mark.parametrize("cfg,params,gb,kv_kib", [
    # 8.03B parameters, 16.06 GB in bf16 (the model card's "8B"; the safetensors total),
    # KV 2 * 32 layers * 8 heads * 128 * 2 B = 128 KiB per token
    (LLAMA3_8B, 8.03e9, 16.06e9, 128),
    # 70.6B parameters, ~141 GB in bf16; KV 2 * 80 * 8 * 128 * 2 B = 320 KiB
    (LLAMA3_70B, 70.6e9, 141e9, 320),
])
def test_llama3_against_published_sizes(cfg, params, gb, kv_kib):
    m = ModelCost(ArchSpec.from_config(cfg))
    assert m.total_params == pytest.approx(params, rel=0.02)
    assert m.weight_bytes == pytest.approx(gb, rel=0.02)
    assert m.kv_bytes_per_token == kv_kib * 1024  # exact
    # decode at batch 1 reads every matmul weight: all but the embedding table
    assert m.weight_bytes_read_per_step == pytest.approx(
        m.weight_bytes - 128256 * cfg["hidden_size"] * 2, rel=1e-4)


def test_mixtral_8x7b_against_published_sizes():
    # mistralai/Mixtral-8x7B-v0.1 config.json; Mistral AI's announcement: 46.7B total
    # parameters, 12.9B used per token (embeddings included)
    cfg = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
           "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
           "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
           "tie_word_embeddings": False}
    m = ModelCost(ArchSpec.from_config(cfg))
    assert m.total_params == pytest.approx(46.7e9, rel=0.02)
    assert m.active_params + 32000 * 4096 == pytest.approx(12.9e9, rel=0.02)
    # a 64-token decode batch touches almost every expert: 8 * (1 - 0.75^64)
    assert m.experts_touched(64) == pytest.approx(8 * (1 - 0.75 ** 64))
    assert math.isclose(m.weight_bytes_read(10**6), m.weight_bytes - 32000 * 4096 * 2,
                        rel_tol=1e-4)
