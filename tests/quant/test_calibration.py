"""Calibration windows: shape, determinism, chat formatting, sources."""

import pytest

from llmctl.errors import UsageError
from llmctl.quant.calibration import CalibrationSpec, build_calibration


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from llmctl.models.loading import load_tokenizer

    return load_tokenizer(tiny_llama)


def test_windows_are_deterministic_per_seed(tokenizer):
    a = build_calibration(tokenizer, CalibrationSpec(samples=6, seq_len=40, seed=1))
    b = build_calibration(tokenizer, CalibrationSpec(samples=6, seq_len=40, seed=1))
    c = build_calibration(tokenizer, CalibrationSpec(samples=6, seq_len=40, seed=2))
    assert a.ids.shape == (6, 40) and a.tokens == 240
    assert a.sha256 == b.sha256 != c.sha256
    assert a.source_sha256 == c.source_sha256  # same text, different windows
    info = a.to_dict()
    assert info["source"] == "builtin:pydoc-calib" and info["tokens_sha256"] == a.sha256


def test_chat_template_wraps_documents(tokenizer, tmp_path):
    path = tmp_path / "short.jsonl"
    path.write_text("\n".join(f'{{"text": "Explain list comprehensions, item {i}."}}'
                               for i in range(100)))
    plain = build_calibration(tokenizer, CalibrationSpec(str(path), samples=8, seq_len=32))
    chat = build_calibration(tokenizer, CalibrationSpec(str(path), samples=8, seq_len=32,
                                                        chat_template=True))
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert (chat.ids == start).sum() >= 8 and not (plain.ids == start).any()
    assert chat.sha256 != plain.sha256


def test_local_jsonl_with_field(tokenizer, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(f'{{"body": "The quick brown fox jumps over the lazy dog. {i}"}}'
                              for i in range(200)))
    calib = build_calibration(tokenizer, CalibrationSpec(str(path), field="body", samples=3,
                                                         seq_len=16))
    assert calib.ids.shape == (3, 16) and calib.documents == 200


def test_bad_sizes_are_usage_errors():
    with pytest.raises(UsageError):
        CalibrationSpec(samples=0)
