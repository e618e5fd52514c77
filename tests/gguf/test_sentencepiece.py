"""SentencePiece-style (Llama 2 / Mistral) vocabularies: scores, byte tokens, llama.cpp."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmctl.gguf.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, read_hf_vocab

SPM_STRINGS = [
    "Hello world",
    "The file object is returned by open().",
    "tabs\tand\nnewlines  and   spaces",
    "naïve café 東京 🚀",  # mostly unseen: byte fallback
    "numbers 12345 and 3.14",
]


def build_spm_llama(out: Path) -> Path:
    """A tiny Llama with a Llama-2-style tokenizer: BPE + byte fallback + '▁' spaces."""
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from tests.tiny import corpus

    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    # Train with word splitting so no piece spans two words (as SentencePiece does),
    # then drop it: Llama 2's tokenizer.json has no pre-tokenizer.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials + byte_tokens,
                                  show_progress=False)
    tok.train_from_iterator(corpus()[:100], trainer)
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    out.mkdir(parents=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.save_pretrained(str(out))
    config = AutoConfig.for_model("llama", vocab_size=len(fast), hidden_size=64,
                                  intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def spm_llama(tmp_path_factory):
    return build_spm_llama(tmp_path_factory.mktemp("spm") / "spm-llama")


def test_vocab_is_exported_as_a_llama_sentencepiece_vocab(spm_llama):
    import json

    vocab = read_hf_vocab(spm_llama, json.loads((spm_llama / "config.json").read_text()))
    assert (vocab.model, vocab.pre, vocab.add_space_prefix) == ("llama", "default", True)
    assert vocab.merges == [] and vocab.scores is not None
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    assert vocab.token_types[ids["<unk>"]] == UNKNOWN
    assert vocab.token_types[ids["<s>"]] == CONTROL and vocab.token_types[ids["</s>"]] == CONTROL
    assert vocab.token_types[ids["<0x41>"]] == BYTE
    merged = [t for t in vocab.tokens if t.startswith("▁") and len(t) > 3]
    assert merged and all(vocab.token_types[ids[t]] == NORMAL for t in merged)
    # earlier merges score higher: llama.cpp merges the best-scored pair first
    assert vocab.scores[ids[merged[0]]] <= 0


def test_llama_cpp_tokenizes_the_sentencepiece_export_like_hf(llama_cpp, spm_llama, tmp_path):
    from transformers import AutoTokenizer

    from llmctl.gguf.export import quantize_to_gguf
    from llmctl.gguf.llamacpp import LlamaCppModel

    summary = quantize_to_gguf(spm_llama, tmp_path / "spm.gguf", "F32")
    tok = AutoTokenizer.from_pretrained(str(spm_llama))
    with LlamaCppModel(summary["path"], vocab_only=True) as model:
        for text in SPM_STRINGS:
            assert model.tokenize(text, special=False) == tok.encode(text, add_special_tokens=False), text
            assert model.tokenize(text, add_bos=True) == tok.encode(text), text
