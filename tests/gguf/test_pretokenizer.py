"""Naming the BPE pre-tokenizer for llama.cpp: known hashes, structure, fallback."""

import json
import logging

import pytest

from llmctl.gguf.pretokenizer import (
    CHECK_TEXT,
    KNOWN_HASHES,
    STRUCTURES,
    check_hash,
    detect_pre_tokenizer,
    structure_of,
)


def _retokenized(tiny_llama, tmp_path, pre_tokenizer):
    """The tiny tokenizer with another pre-tokenizer (a new, unknown hash)."""
    from transformers import PreTrainedTokenizerFast

    out = tmp_path / "tok"
    out.mkdir()
    data = json.loads((tiny_llama / "tokenizer.json").read_text())
    data["pre_tokenizer"] = pre_tokenizer
    (out / "tokenizer.json").write_text(json.dumps(data))
    for name in ("tokenizer_config.json",):
        (out / name).write_text((tiny_llama / name).read_text())
    return out, PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))


def test_check_hash_is_sha256_of_the_printed_ids():
    class Fake:
        def encode(self, text):
            assert text == CHECK_TEXT
            return [1, 2, 3]

    import hashlib
    assert check_hash(Fake()) == hashlib.sha256(b"[1, 2, 3]").hexdigest()


def test_known_hash_wins(tiny_llama, monkeypatch):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    monkeypatch.setitem(KNOWN_HASHES, check_hash(tok), ("qwen2", "made-up/model"))
    match = detect_pre_tokenizer(tiny_llama, tok)
    assert (match.name, match.method, match.detail) == ("qwen2", "hash", "made-up/model")


def test_unknown_hash_falls_back_to_the_structure(tiny_llama):
    match = detect_pre_tokenizer(tiny_llama)
    assert (match.name, match.method) == ("gpt-2", "structure")


def test_digit_splitting_structure_is_smollm(tiny_llama, tmp_path):
    pre = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    directory, tok = _retokenized(tiny_llama, tmp_path, pre)
    assert structure_of(json.loads((directory / "tokenizer.json").read_text())) in STRUCTURES
    assert detect_pre_tokenizer(directory, tok).name == "smollm"


def test_unknown_structure_warns_and_uses_default(tiny_llama, tmp_path, caplog):
    directory, tok = _retokenized(tiny_llama, tmp_path, {"type": "Whitespace"})
    with caplog.at_level(logging.WARNING):
        match = detect_pre_tokenizer(directory, tok)
    assert (match.name, match.method) == ("default", "fallback")
    assert "tokenization may differ" in caplog.text


@pytest.mark.slow
def test_smollm2_is_recognised_by_its_hash(smollm2):
    match = detect_pre_tokenizer(smollm2)
    assert (match.name, match.method) == ("smollm", "hash")
