"""``llmctl info FILE.gguf`` reads any GGUF: K-quants, imatrix files, foreign metadata."""

from __future__ import annotations

import json

import gguf
import numpy as np
from typer.testing import CliRunner

from llmctl.cli.app import build_app
from llmctl.gguf.summary import summarize_gguf

runner = CliRunner()


def _info(*args):
    return runner.invoke(build_app(), ["info", *args])


def test_info_reads_a_non_model_gguf_with_odd_types(tmp_path):
    """No architecture, a long array, an I32 tensor and a Q4_K tensor: still summarised."""
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), arch="something-new")
    writer.add_string("general.type", "experiment")
    writer.add_array("odd.long_list", list(range(1000)))
    writer.add_array("odd.short_list", [1, 2, 3])
    writer.add_tensor("ids", np.arange(64, dtype=np.int32))
    q4k = gguf.quants.quantize(np.ones((2, 256), np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("w", q4k, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    result = _info(str(path), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["metadata"]["general.architecture"] == "something-new"
    assert data["metadata"]["odd.long_list"] == "[1000 items]"
    assert data["metadata"]["odd.short_list"] == [1, 2, 3]
    assert data["types"] == {"I32": 1, "Q8_0": 1}
    assert data["n_parameters"] == 64 + 512
    assert data["tensor_bytes"] == 64 * 4 + 2 * 8 * 34
    human = _info(str(path), "--tensors")
    assert human.exit_code == 0 and "Q8_0" in human.output and "odd.long_list" in human.output


def test_info_of_an_llmctl_export_matches_its_summary(tiny_llama, tmp_path):
    from llmctl.gguf.export import quantize_to_gguf

    summary = quantize_to_gguf(tiny_llama, tmp_path / "t.gguf", "Q5_1")
    data = json.loads(_info(summary["path"], "--json").stdout)
    assert data["types"] == summary["types"] == summarize_gguf(tmp_path / "t.gguf")["types"]
    assert data["bits_per_weight"] == summary["bits_per_weight"]
    assert data["metadata"]["tokenizer.ggml.pre"] == "gpt-2"
    assert data["metadata"]["tokenizer.ggml.tokens"] == "[512 items]"
