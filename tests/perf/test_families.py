"""Parameters, KV bytes and plans of every family, against hand-computed numbers.

The realistic configs are the published config.json values of Gemma-2-2B, Gemma-3-1B,
Phi-4-mini, Granite-3.1-2B and OLMo-2-1B (written from memory of those files: no
download; Phi-4-mini's 48 LongRoPE factors are placeholders, they change no count).
Every parameter count below is worked out by hand in its comment; the published totals
(2.61B, 1.00B, 3.84B, 2.53B, 1.48B) agree.

KV of one sequence of L tokens: ``sum_l min(L, W_l) * 2 * kv_heads * head_dim * bytes``.
"""

from __future__ import annotations

import pytest

from llmctl.perf.arch import ArchSpec
from llmctl.perf.costs import ModelCost
from llmctl.perf.devices import device_peaks
from llmctl.perf.footprint import footprint
from llmctl.perf.plan import PlanOptions, make_plan
from llmctl.perf.weight_format import NAMED

GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304, "intermediate_size": 9216, "max_position_embeddings": 8192,
    "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "sliding_window": 4096, "vocab_size": 256000, "torch_dtype": "float32"}
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
    "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "intermediate_size": 6912, "max_position_embeddings": 32768, "num_attention_heads": 4,
    "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "vocab_size": 262144, "torch_dtype": "bfloat16"}
PHI4_MINI = {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_act": "silu",
    "hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 24,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 200064,
    "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
    "partial_rotary_factor": 0.75, "rope_theta": 10000.0, "sliding_window": 262144,
    "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 48,
                     "short_factor": [1.0] * 48},
    "tie_word_embeddings": True, "rms_norm_eps": 1e-05, "attention_bias": False,
    "torch_dtype": "bfloat16"}
GRANITE_31_2B = {
    "architectures": ["GraniteForCausalLM"], "model_type": "granite",
    "attention_bias": False, "attention_multiplier": 0.015625, "embedding_multiplier": 12.0,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
    "logits_scaling": 8.0, "max_position_embeddings": 131072, "num_attention_heads": 32,
    "num_hidden_layers": 40, "num_key_value_heads": 8, "residual_multiplier": 0.22,
    "rms_norm_eps": 1e-05, "rope_theta": 5000000.0, "tie_word_embeddings": True,
    "vocab_size": 49155, "torch_dtype": "bfloat16"}
OLMO2_1B = {
    "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16,
    "num_hidden_layers": 16, "num_key_value_heads": 16, "vocab_size": 100352,
    "max_position_embeddings": 4096, "rope_theta": 500000, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "float32"}

REAL = {"gemma2-2b": GEMMA2_2B, "gemma3-1b": GEMMA3_1B, "phi4-mini": PHI4_MINI,
        "granite3.1-2b": GRANITE_31_2B, "olmo2-1b": OLMO2_1B}

# name -> (parameters, KV bytes of one bf16 token in every layer)
HAND = {
    # tied embed 256000*2304 = 589,824,000; a layer: q 2304*2048 + k, v 2304*1024 each + o
    # 2048*2304 = 14,155,776, MLP 3*2304*9216 = 63,700,992, 4 norms 9216 -> 77,865,984;
    # 26 layers + final norm 2304. KV: 26 * 2 * 4 * 256 * 2
    "gemma2-2b": (2_614_341_888, 106_496),
    # tied embed 262144*1152 = 301,989,888; a layer: attn 2*1152*1024 + 2*1152*256 =
    # 2,949,120, MLP 3*1152*6912 = 23,887,872, 4 norms 4608, q/k norms 2*256 -> 26,842,112;
    # 26 layers + 1152. KV: 26 * 2 * 1 * 256 * 2
    "gemma3-1b": (999_885_952, 26_624),
    # tied embed 200064*3072 = 614,596,608; head_dim 128; a layer: qkv (24+16)*128*3072 =
    # 15,728,640, o 9,437,184, gate_up 2*8192*3072 = 50,331,648, down 25,165,824, 2 norms
    # 6144 -> 100,669,440; 32 layers + 3072. KV: 32 * 2 * 8 * 128 * 2
    "phi4-mini": (3_836_021_760, 131_072),
    # tied embed 49155*2048 = 100,669,440; a layer: attn 2*2048^2 + 2*2048*512 = 10,485,760,
    # MLP 3*2048*8192 = 50,331,648, 2 norms 4096 -> 60,821,504; 40 layers + 2048.
    # KV: 40 * 2 * 8 * 64 * 2 (head_dim 2048 / 32)
    "granite3.1-2b": (2_533_531_648, 81_920),
    # untied embed + head 2*100352*2048 = 411,041,792; a layer: attn 4*2048^2 = 16,777,216,
    # MLP 50,331,648, 2 post-norms 4096, q/k norms over the projections 2*2048 ->
    # 67,117,056; 16 layers + 2048. KV: 16 * 2 * 16 * 128 * 2
    "olmo2-1b": (1_484_916_736, 131_072),
}

# name -> (context, KV bytes of one bf16 sequence of that context, windows counted)
KV_AT = {
    # 13 sliding layers (window 4096) + 13 full, 4096 B per layer-token
    "gemma2-2b": (8192, (13 * 4096 + 13 * 8192) * 4096),
    # layers 5, 11, 17, 23 full (pattern 6), 22 sliding at 512; 1024 B per layer-token
    "gemma3-1b": (32768, (22 * 512 + 4 * 32768) * 1024),
    # a window of 262144 past the context: every layer holds all 131072 tokens
    "phi4-mini": (131072, 131072 * 131_072),
    "granite3.1-2b": (131072, 131072 * 81_920),
    "olmo2-1b": (4096, 4096 * 131_072),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_parameters_and_kv_per_token(name):
    cost = ModelCost.from_config(REAL[name])
    params, kv_token = HAND[name]
    assert cost.total_params == params
    assert cost.kv_bytes_per_token == kv_token
    context, kv = KV_AT[name]
    assert cost.sequence_kv_bytes(context) == kv
    fp = footprint(REAL[name])
    assert (fp.parameters, fp.context, fp.kv_bytes_context) == (params, context, kv)
    assert fp.weight_format == "bf16"  # a float32 checkpoint is served in bf16


def test_windows_below_the_window_cost_as_full_attention():
    cost = ModelCost.from_config(GEMMA2_2B)
    assert cost.sequence_kv_bytes(4096) == 4096 * 106_496
    assert cost.sequence_kv_bytes(4097) == 4096 * 106_496 + 13 * 4096  # only full layers grow


def test_attention_flops_count_each_layers_window():
    arch = ArchSpec.from_config(GEMMA3_1B)
    per_key = 4 * 4 * 256  # 4 query heads of 256
    cost = ModelCost(arch)
    assert cost.flops_per_token(1000) == 2 * cost.active_params + per_key * (22 * 512 + 4 * 1000)
    # prefill of 600 tokens: a full layer sums p + 1 = 1..600, a sliding one min(p + 1, 512)
    full, sliding = 600 * 601 // 2, 512 * 513 // 2 + 88 * 512
    assert arch.attended_keys(600) == 4 * full + 22 * sliding
    assert arch.attended_keys(600, 100) == 4 * (full - 5050) + 22 * (sliding - 5050)


def test_plan_counts_gemma2_kv_at_the_planned_context():
    """KV per token is the average over a sequence of the context: (13 * 4096 + 13 * 8192)
    layer-tokens * 4096 B / 8192 tokens = 79,872 B; the capacity in sequences follows."""
    peaks = device_peaks("h100-80gb")
    plan = make_plan(ArchSpec.from_config(GEMMA2_2B), NAMED["bf16"], peaks,
                     PlanOptions(context=8192))
    m = plan.memory
    assert m.kv_bytes_per_token == 79_872
    assert m.max_concurrency == int(m.kv_budget_bytes // (8192 * 79_872))
    assert any("sliding-window" in note for note in plan.notes)
    short = make_plan(ArchSpec.from_config(GEMMA2_2B), NAMED["bf16"], peaks,
                      PlanOptions(context=2048))
    assert short.memory.kv_bytes_per_token == 106_496  # within the window: every layer


def test_tiny_family_configs(tiny_family):
    """The tiny configs (vocab 512, hidden 64, 4 layers, 4 heads / 2 KV heads of 16):
    128 B per layer-token in bf16."""
    import json

    for name, kv_512 in (("gemma2", (2 * 8 + 2 * 512) * 128), ("phi3", 4 * 16 * 128),
                         ("olmo2", 4 * 512 * 128), ("gemma3", (3 * 8 + 512) * 128)):
        config = json.loads((tiny_family(name) / "config.json").read_text())
        fp = footprint(config, context=512)
        assert fp.kv_bytes_per_token == 512 and fp.kv_bytes_context == kv_512, name
