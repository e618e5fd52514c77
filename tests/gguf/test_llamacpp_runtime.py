"""GGUF files llmctl writes, run by llama.cpp itself: tokenization, logits, decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gguf.conftest import TOKENIZER_STRINGS


def _hf(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(path))


def _hf_logits(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].numpy()


def _hf_greedy(model, ids, n):
    """Argmax decoding that does not stop at eos, so n tokens are always compared."""
    out, past, x = [], None, torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(n):
            step = model(x, past_key_values=past, use_cache=True)
            past = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out


def _assert_greedy_within(model, ids, continuation, atol):
    """Reduced precision: each token llama.cpp picked greedily is, on the same sequence,
    within ``2 * atol`` of transformers' float32 best logit. With every logit within
    ``atol`` that is all argmax can promise: where the top-2 are closer, either may win,
    depending on the CPU's kernels (exact token equality belongs to float32)."""
    ref = _hf_logits(model, ids + continuation)[len(ids) - 1:-1]
    chosen = ref[np.arange(len(continuation)), continuation]
    np.testing.assert_array_less(ref.max(-1) - chosen, 2 * atol)


def _assert_same_tokens(gguf_path, hf_dir):
    from transformers import AutoTokenizer

    from llmctl.gguf.llamacpp import LlamaCppModel

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    with LlamaCppModel(gguf_path, vocab_only=True) as model:
        for text in TOKENIZER_STRINGS:
            ours = model.tokenize(text, add_bos=False, special=True)
            theirs = tok.encode(text, add_special_tokens=False)
            assert ours == theirs, text


def test_tiny_export_tokenizes_like_hf(llama_cpp, tiny_llama, tiny_gguf):
    _assert_same_tokens(tiny_gguf, tiny_llama)


def test_tiny_f32_logits_match_transformers(llama_cpp, tiny_llama, tiny_gguf):
    from llmctl.gguf.llamacpp import LlamaCppModel

    model, tok = _hf(tiny_llama)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 3)
    ref = _hf_logits(model, ids)
    with LlamaCppModel(tiny_gguf, n_ctx=128) as gg:
        ours = gg.logits(ids)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, atol=2e-5 * np.abs(ref).max(), rtol=0)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("fixture", ["tiny_gguf", "tiny_f16_gguf"])
def test_tiny_greedy_continuation_equals_transformers(llama_cpp, tiny_llama, fixture, request):
    from llmctl.gguf.llamacpp import LlamaCppModel

    path = request.getfixturevalue(fixture)
    model, tok = _hf(tiny_llama)
    ids = tok.apply_chat_template([{"role": "user", "content": "Describe a class."}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with LlamaCppModel(path, n_ctx=128) as gg:
        ours = gg.greedy(ids, 32)
    if fixture == "tiny_gguf":  # F32: the same tokens
        assert ours == _hf_greedy(model, ids, 32)
    else:  # F16: as close as test_tiny_f16_logits_close_to_transformers allows
        atol = 5e-3 * np.abs(_hf_logits(model, ids)).max()
        _assert_greedy_within(model, ids, ours, atol)


def test_tiny_f16_logits_close_to_transformers(llama_cpp, tiny_llama, tiny_f16_gguf):
    from llmctl.gguf.llamacpp import LlamaCppModel

    model, tok = _hf(tiny_llama)
    ids = tok.encode("Sequences, tuples and lists are described in this section.")
    ref = _hf_logits(model, ids)
    with LlamaCppModel(tiny_f16_gguf, n_ctx=64) as gg:
        ours = gg.logits(ids)
    # F16 weights and llama.cpp's F16 activations: ~3 decimal digits.
    np.testing.assert_allclose(ours, ref, atol=5e-3 * np.abs(ref).max(), rtol=0)


@pytest.mark.slow
def test_smollm2_f16_export_runs_in_llama_cpp_like_transformers(llama_cpp, smollm2, tmp_path):
    from llmctl.gguf.export import quantize_to_gguf
    from llmctl.gguf.llamacpp import LlamaCppModel

    summary = quantize_to_gguf(smollm2, tmp_path / "smollm2-f16.gguf", "F16")
    assert summary["tokenizer"]["pre"] == "smollm"
    _assert_same_tokens(summary["path"], smollm2)
    model, tok = _hf(smollm2)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    ref = _hf_logits(model, ids)
    with LlamaCppModel(summary["path"], n_ctx=256) as gg:
        ours = gg.logits(ids)
        continuation = gg.greedy(ids, 32)
    atol = 2e-2 * np.abs(ref).max()
    np.testing.assert_allclose(ours, ref, atol=atol, rtol=0)
    assert len(continuation) == 32
    _assert_greedy_within(model, ids, continuation, atol)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "mistral"])
def test_other_families_export_to_matching_logits(llama_cpp, tmp_path, model_type):
    """Qwen2 (q/k/v biases, no RoPE permutation), Qwen3 (q/k norms, head_dim 128 != 64/4)
    and Mistral (the llama graph) through llama.cpp, against transformers."""
    from llmctl.gguf.compare import llamacpp_logits, transformers_logits
    from llmctl.gguf.export import quantize_to_gguf
    from tests.tiny import build_tiny_llama

    model = build_tiny_llama(tmp_path / model_type, layers=1, model_type=model_type)
    summary = quantize_to_gguf(model, tmp_path / f"{model_type}.gguf", "F32")
    ids = [list(range(3, 40))]
    ref = transformers_logits(model, ids)[0]
    ours = llamacpp_logits(summary["path"], ids)[0]
    np.testing.assert_allclose(ours, ref, atol=2e-5 * np.abs(ref).max(), rtol=0)
