"""quantize_to_gguf with llmctl's own writer: plans, overrides, fallbacks, summary, atomicity."""

from __future__ import annotations

import numpy as np
import pytest

from llmctl.errors import MissingDependencyError, UsageError
from llmctl.gguf.export import plan_gguf, quantize_to_gguf
from llmctl.models.gguf_reader import open_checkpoint, read_metadata


def _types(path):
    return {t.name: t.type for t in read_metadata(path)[1]}


def test_dry_run_plan_is_what_gets_written(tiny_llama, tmp_path):
    recipe = {"output_type": "Q8_0", "overrides": [{"pattern": r"attn_v\.", "type": "Q8_0"},
                                                    {"pattern": r"attn_", "type": "Q5_1"}]}
    plan = quantize_to_gguf(tiny_llama, tmp_path / "never.gguf", "Q4_0", recipe, dry_run=True)
    assert plan["dry_run"] and not (tmp_path / "never.gguf").exists()
    planned = {t["name"]: t["type"] for t in plan["tensors"]}
    assert planned["output.weight"] == "Q8_0"
    assert planned["blk.0.attn_v.weight"] == "Q8_0"  # first matching override wins
    assert planned["blk.1.attn_q.weight"] == "Q5_1"
    assert planned["blk.0.ffn_down.weight"] == "Q4_0"
    assert planned["blk.0.attn_norm.weight"] == "F32"  # 1-D tensors stay F32
    assert planned["token_embd.weight"] == "Q4_0"

    summary = quantize_to_gguf(tiny_llama, tmp_path / "out.gguf", "Q4_0", recipe)
    assert _types(summary["path"]) == planned
    assert summary["tensor_bytes"] == plan["tensor_bytes"]
    assert summary["types"] == plan["types"] == {"Q4_0": 7, "Q5_1": 6, "F32": 5, "Q8_0": 3}
    n = sum(np.prod(t["shape"]) for t in summary["tensors"])
    assert summary["bits_per_weight"] == pytest.approx(8 * summary["tensor_bytes"] / n)
    assert summary["size"] == (tmp_path / "out.gguf").stat().st_size
    assert summary["engine"] == "llmctl" and summary["fallbacks"] == []


def test_rows_that_do_not_fit_a_block_fall_back_to_f16(tiny_llama_48, tmp_path):
    plan = plan_gguf(tiny_llama_48, "Q8_0")
    by_name = {t["name"]: t for t in plan["tensors"]}
    q = by_name["blk.0.attn_q.weight"]  # 48 columns: not a multiple of 32
    assert q["type"] == "F16" and q["note"].startswith("fallback: 48 columns")
    assert by_name["blk.0.ffn_down.weight"]["type"] == "Q8_0"  # 96 columns fit


@pytest.fixture(scope="module")
def tiny_llama_48(tmp_path_factory):
    from tests.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny48") / "m", hidden_size=48,
                            intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                            layers=1)


@pytest.mark.parametrize("gguf_type, step", [("BF16", 2 ** -8), ("Q4_1", 1 / 15), ("Q5_0", 1 / 15),
                                             ("Q5_1", 1 / 31)])
def test_every_llmctl_type_reads_back_within_a_step(tiny_llama, tmp_path, gguf_type, step):
    from safetensors.numpy import load_file

    summary = quantize_to_gguf(tiny_llama, tmp_path / f"m-{gguf_type}.gguf", gguf_type)
    original = load_file(str(tiny_llama / "model.safetensors"))
    for name, array in open_checkpoint(summary["path"]).tensors():
        ref = original[name]
        bound = step * 2 * np.abs(ref).max() + 1e-6  # range / levels, range <= 2 absmax
        assert np.abs(array - ref).max() <= bound, name


def test_failed_export_leaves_no_file(tiny_llama, tmp_path, monkeypatch):
    from llmctl.gguf import writer

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(writer, "_encode", boom)
    with pytest.raises(RuntimeError):
        quantize_to_gguf(tiny_llama, tmp_path / "out.gguf", "Q8_0")
    assert list(tmp_path.iterdir()) == []  # no partial output, no temp files


def test_progress_reaches_the_total(tiny_llama, tmp_path):
    seen = []
    quantize_to_gguf(tiny_llama, tmp_path / "p.gguf", "Q8_0", progress=lambda d, t: seen.append((d, t)))
    assert seen[-1][0] == seen[-1][1] > 0
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_llama_cpp_types_say_how_to_install_it(tiny_llama, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_llama(name, *args, **kwargs):
        if name == "llama_cpp":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llama)
    with pytest.raises(MissingDependencyError, match="llama-cpp-python"):
        quantize_to_gguf(tiny_llama, tmp_path / "k.gguf", "Q4_K_M")
    assert not (tmp_path / "k.gguf").exists()


def test_output_must_be_a_gguf_path(tiny_llama, tmp_path):
    with pytest.raises(UsageError, match=r"\.gguf"):
        quantize_to_gguf(tiny_llama, tmp_path / "model", "Q8_0")
    with pytest.raises(UsageError, match="no output file"):
        quantize_to_gguf(tiny_llama, None, "Q8_0")


def test_dry_run_needs_no_output_path(tiny_llama):
    plan = quantize_to_gguf(tiny_llama, gguf_type="Q8_0", dry_run=True)
    assert plan["dry_run"] and plan["types"] == {"Q8_0": 16, "F32": 5}
