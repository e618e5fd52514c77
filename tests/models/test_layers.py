"""The shared layer building blocks compute what transformers computes, bit for bit where
transformers' op order is kept (RoPE tables, RMSNorm, the rotations, activations)."""

from __future__ import annotations

import pytest
import torch

from llmctl.errors import UnsupportedArchitectureError
from llmctl.models import layers
from llmctl.models.layers import RMSNorm, RoPE
from llmctl.models.spec import ModelArch

pytest.importorskip("transformers")

SMALL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256}
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
               "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
             "rope_theta": 10000.0},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                    "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 16,
                    "rope_theta": 1000000.0},
}


def _config(rope: dict, **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model("llama", **{**SMALL, "rope_parameters": dict(rope), **overrides})


def _hf_inv_freq(config):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[kind](config, None)


@pytest.mark.parametrize("name", sorted(ROPES))
def test_inv_freq_per_rope_type_is_transformers(name):
    config = _config(ROPES[name])
    arch = ModelArch.from_config(config.to_dict())
    want, want_factor = _hf_inv_freq(config)
    got, factor = layers.inv_freq(arch.rope, arch.head_dim, arch.max_position_embeddings)
    assert torch.equal(got, want.float())
    assert factor == pytest.approx(want_factor, abs=0)


@pytest.mark.parametrize("name", ["linear", "llama3", "yarn"])
def test_partial_rotary_inv_freq_is_transformers(name):
    config = _config({**ROPES[name], "partial_rotary_factor": 0.5})
    rope = RoPE.of(ModelArch.from_config(config.to_dict()))
    assert rope.partial_rotary_factor == 0.5
    want, _ = _hf_inv_freq(config)
    got, _ = layers.inv_freq(rope.params, layers.rotary_dim(16, 0.5), 256)
    assert got.shape == (4,) and torch.equal(got, want.float())
    cos, sin = rope.cos_sin(10)
    assert cos.shape == sin.shape == (10, 8)
    assert rope.freqs(10).shape == (10, 4)


@pytest.mark.parametrize("name", sorted(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cos_sin_tables_are_transformers_rotary_embedding(name, dtype):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _config(ROPES[name])
    want = LlamaRotaryEmbedding(config=config)(torch.empty(1, dtype=dtype),
                                               torch.arange(48)[None])
    cos, sin = RoPE.of(ModelArch.from_config(config.to_dict())).cos_sin(48)
    assert torch.equal(cos[None].to(dtype), want[0]) and torch.equal(sin[None].to(dtype), want[1])


def test_unknown_rope_type_is_refused_with_the_known_ones():
    with pytest.raises(UnsupportedArchitectureError, match="xpos") as err:
        layers.inv_freq({"rope_type": "xpos", "rope_theta": 1e4}, 16, 64)
    assert "llama3" in err.value.remedy


def test_rotate_halves_is_transformers_apply_rotary_pos_emb():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 12, 16, generator=g), torch.randn(2, 2, 12, 16, generator=g)
    cos, sin = layers.rope_cos_sin(ROPES["default"], 16, 256, 12)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    c, s = cos[None, None], sin[None, None]
    assert torch.equal(layers.rotate_halves(q, c, s), want_q)
    assert torch.equal(layers.rotate_halves(k, c, s), want_k)


def test_partial_rotation_is_transformers_phi3():
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 4, 9, 16, generator=g), torch.randn(1, 2, 9, 16, generator=g)
    cos, sin = layers.rope_cos_sin(ROPES["default"], 16, 256, 9, partial=0.5)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    c, s = cos[None, None], sin[None, None]
    assert torch.equal(layers.rotate_halves(q, c, s), want_q)
    assert torch.equal(layers.rotate_halves(k, c, s), want_k)
    assert torch.equal(layers.rotate_halves(q, c, s)[..., 8:], q[..., 8:])


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_pairs_layout_gives_the_halves_rotation_on_permuted_rows(partial):
    from llmctl.models.architectures import rope_permute

    rot = layers.rotary_dim(16, partial)
    x = torch.randn(7, 3, 16, generator=torch.Generator().manual_seed(2))
    cos, sin = layers.rope_cos_sin(ROPES["llama3"], 16, 256, 7, partial=partial)
    freqs = layers.rope_freqs(ROPES["llama3"], 16, 256, 7, partial=partial)
    halves = layers.rotate_halves(x, cos[:, None], sin[:, None])

    def to_pairs(t):  # the rotated dims of each head in interleaved-pair order
        rows = t[..., :rot].permute(2, 0, 1)
        paired = rope_permute(rows, 1).permute(1, 2, 0)
        return torch.cat([paired, t[..., rot:]], dim=-1)

    got = layers.rotate_pairs(to_pairs(x), freqs[:, None])
    torch.testing.assert_close(got, to_pairs(halves), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_is_transformers_llama_and_gemma(dtype):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 7, 64, generator=g) * 3).to(dtype)
    w = torch.randn(64, generator=g)
    llama, gemma = LlamaRMSNorm(64, eps=1e-5), GemmaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        llama.weight.copy_(w)
        gemma.weight.copy_(w)
        llama, gemma = llama.to(dtype), gemma.to(dtype)
        assert torch.equal(RMSNorm(1e-5)(x, w.to(dtype)), llama(x))
        assert torch.equal(RMSNorm(1e-5, offset=1.0)(x, w.to(dtype)), gemma(x))
    if dtype == torch.float32:  # torch's fused op: the same numbers in float32
        assert torch.equal(RMSNorm(1e-5).fused(x, w), llama(x))
        torch.testing.assert_close(RMSNorm(1e-5, 1.0).fused(x, w), gemma(x))


def test_add_rms_norm_adds_the_residual_in_place():
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.rand(8)
    total = x + r
    out = layers.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(x, total)
    assert torch.equal(out, layers.fused_rms_norm(total, w, 1e-6))


def test_the_family_row_sets_the_norm_offset():
    gemma = ModelArch.from_config({"model_type": "gemma2", "hidden_size": 64,
                                   "num_attention_heads": 4, "num_hidden_layers": 2,
                                   "intermediate_size": 96, "vocab_size": 128})
    assert RMSNorm.of(gemma) == RMSNorm(1e-6, 1.0)
    assert gemma.hidden_act == "gelu_pytorch_tanh"


@pytest.mark.parametrize("name", sorted(layers.ACTIVATIONS))
def test_activations_are_transformers_act2fn(name):
    from transformers.activations import ACT2FN

    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(4)) * 4
    assert torch.equal(layers.activation(name)(x), ACT2FN[name](x))
    gate_up = torch.randn(3, 2 * 8)
    assert torch.equal(layers.fused_gated(name)(gate_up),
                       layers.gated(ACT2FN[name], gate_up[:, :8], gate_up[:, 8:]))


def test_unknown_activation_is_refused():
    with pytest.raises(UnsupportedArchitectureError, match="relu2"):
        layers.activation("relu2")


def test_repeat_kv_is_transformers():
    from transformers.models.llama.modeling_llama import repeat_kv

    x = torch.randn(2, 3, 5, 4)
    assert torch.equal(layers.repeat_kv(x, 4), repeat_kv(x, 4))
    assert layers.repeat_kv(x, 1) is x


def test_sliding_causal_mask():
    mask = layers.sliding_causal_mask(5, 2)
    for i in range(5):
        assert mask[i].nonzero().flatten().tolist() == [j for j in range(5) if i - 2 < j <= i]


def test_softcap_scores_as_transformers_eager_attention():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) * 3 for _ in range(3))
    cap, scale = 5.0, 0.3
    scores = torch.tanh(q @ k.transpose(-2, -1) * scale / cap) * cap
    scores = scores + torch.full((6, 6), float("-inf")).triu(1)
    want = torch.softmax(scores, dim=-1) @ v
    got = layers.attend(q, k, v, causal=True, scale=scale, softcap=cap)
    torch.testing.assert_close(got, want)
    # a cap far above every score leaves plain attention
    plain = layers.attend(q, k, v, causal=True)
    torch.testing.assert_close(layers.attend(q, k, v, causal=True, softcap=1e6), plain)
    mask = layers.sliding_causal_mask(6, 3)
    torch.testing.assert_close(layers.attend(q, k, v, mask, softcap=1e6),
                               layers.attend(q, k, v, mask))


def test_qk_norm_normalises_each_head():
    q, k = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 2, 8)
    wq, wk = torch.rand(8), torch.rand(8)
    norm = RMSNorm(1e-6)
    nq, nk = layers.qk_norm(q, k, wq, wk, norm)
    assert torch.equal(nq, norm(q, wq)) and torch.equal(nk, norm(k, wk))
    fq, fk = layers.qk_norm(q, k, wq, wk, norm, fused=True)
    assert torch.equal(fq, norm.fused(q, wq)) and torch.equal(fk, norm.fused(k, wk))


# --- LongRoPE (Phi-3) and Gemma 3's per-layer-type RoPE ----------------------------------
PHI3 = {**SMALL, "original_max_position_embeddings": 32, "partial_rotary_factor": 0.5,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                            "short_factor": [1.0, 1.1, 1.3, 1.6],
                            "long_factor": [1.0, 1.5, 2.5, 4.0]}}


@pytest.mark.parametrize("seq_len", [None, 33])
def test_longrope_inv_freq_is_transformers(seq_len):
    """Both sets against transformers' ``_compute_longrope_parameters`` (the short one for
    a context up to the original 32, the long one past it), with its attention factor
    ``sqrt(1 + ln(256 / 32) / ln(32))``."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.for_model("phi3", **PHI3)
    want, want_factor = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=seq_len)
    arch = ModelArch.from_config(config.to_dict())
    params, dim = arch.rope, layers.rotary_dim(arch.head_dim, arch.partial_rotary_factor)
    got, factor = layers.inv_freq(params, dim, 256)
    if seq_len:
        got, switch_at = layers.rope.SWITCHED["longrope"](params, dim, 256)
        assert switch_at == 32
    assert torch.equal(got, want.float())
    assert factor == pytest.approx(want_factor, abs=0) and factor > 1.0


@pytest.mark.parametrize("length", [32, 48])
def test_longrope_tables_are_transformers_phi3_rotary_for_a_sequence(length):
    """A table of ``length`` positions is transformers' rotary embedding of a sequence of
    that length: the short set up to 32, the long one past it (for every position)."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = AutoConfig.for_model("phi3", **PHI3)
    want = Phi3RotaryEmbedding(config=config)(torch.empty(1), torch.arange(length)[None])
    cos, sin = RoPE.of(ModelArch.from_config(config.to_dict())).cos_sin(length)
    assert torch.equal(cos[None], want[0]) and torch.equal(sin[None], want[1])


@pytest.mark.parametrize("legacy", [False, True])
def test_gemma3_local_and_global_rope_are_transformers(legacy):
    """Gemma 3's sliding layers rotate at the local base, unscaled; its global layers at
    rope_theta with the scaling: the new per-layer-type layout and the old one
    (rope_scaling, rope_local_base_freq) read alike."""
    from transformers import AutoConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    scaling = {"rope_type": "linear", "factor": 8.0}
    if legacy:
        extra = {"rope_scaling": scaling, "rope_theta": 1e6, "rope_local_base_freq": 1e4}
    else:
        extra = {"rope_parameters": {
            "full_attention": {**scaling, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    config = AutoConfig.for_model("gemma3_text", **{**SMALL, "num_hidden_layers": 6},
                                  head_dim=16, **extra)
    arch = ModelArch.from_config(config.to_dict() if not legacy else
                                 {**{k: v for k, v in config.to_dict().items()
                                     if k != "rope_parameters"}, **extra})
    hf = Gemma3RotaryEmbedding(config=config)
    for layer_type, params in (("full_attention", arch.rope),
                               ("sliding_attention", arch.local_rope)):
        want = hf(torch.empty(1), torch.arange(40)[None], layer_type=layer_type)
        cos, sin = layers.rope_cos_sin(params, 16, arch.max_position_embeddings, 40)
        assert torch.equal(cos[None], want[0]) and torch.equal(sin[None], want[1]), layer_type
