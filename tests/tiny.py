"""Tiny random Llama checkpoints for fast tests (seconds, not minutes)."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus() -> list[str]:
    from pydoc_data.topics import topics

    return [text for _, text in sorted(topics.items())]


def build_tokenizer(out: Path, vocab_size: int = 512):
    """A byte-level BPE trained on stdlib prose, with ChatML specials (ids 0, 1, 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus()[:200], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|im_end|>",
                                   unk_token=None)
    fast.chat_template = CHATML
    fast.save_pretrained(str(out))
    return fast


def build_tiny_llama(out: Path, *, seed: int = 0, tie: bool = False, layers: int = 2,
                     model_type: str = "llama", **overrides) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    config_kwargs = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    config_kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Random init gives near-uniform logits; widen them so greedy decoding is decisive
    # and comparisons between implementations are not decided by float noise.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:  # matrices, and the stacked experts [E, out, in]
                param.normal_(0.0, 0.15)
            elif name.endswith(RANDOM_VECTORS.get(model_type, ())):
                param.normal_(0.0, 0.5)  # zero-initialised biases, tiny sinks: made to count
    model.save_pretrained(str(out))
    json.loads((out / "config.json").read_text())
    return out


FAMILY_CONFIGS = Path(__file__).parent / "data" / "families"
# the mixtures of experts (tests/data/families/<name>.json too): tested by their own files
# (tests/serve/model/test_moe.py, tests/quant/test_moe_quant.py,
# tests/gguf/test_moe_export.py); the static engines refuse them, so they stay out of
# FAMILY_NAMES, which the dense family tests of every command run
MOE_FAMILY_NAMES = ("mixtral", "qwen2_moe", "qwen3_moe")
# gpt-oss, a mixture of experts with features of its own (sinks, biases, the clamped
# SwiGLU, fused experts): tested by its own files (tests/serve/model/test_gpt_oss.py,
# tests/quant/test_gpt_oss_quant.py, tests/gguf/test_moe_export.py)
GPT_OSS_FAMILY_NAMES = ("gpt_oss",)
# per model type, the 1-D parameters (name suffixes) drawn at random as well: their
# transformers init is zero (attention biases) or too small to matter (sinks, router bias)
RANDOM_VECTORS = {"gpt_oss": ("bias", "sinks")}
# every dense family llmctl runs, as a tiny config (tests/data/families/<name>.json): each
# exercises its family's features (soft-caps, (1 + w) norms, post-norms, q/k norms,
# multipliers, per-layer RoPE, LongRoPE with partial rotary, sliding windows)
FAMILY_NAMES = tuple(sorted(p.stem for p in FAMILY_CONFIGS.glob("*.json")
                            if p.stem not in MOE_FAMILY_NAMES + GPT_OSS_FAMILY_NAMES))


def build_family(out: Path, name: str, *, seed: int = 0) -> Path:
    """The tiny random checkpoint of ``tests/data/families/<name>.json``."""
    config = json.loads((FAMILY_CONFIGS / f"{name}.json").read_text())
    return build_tiny_llama(out, seed=seed, layers=config.pop("num_hidden_layers"), **config)
