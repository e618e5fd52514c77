"""``llmctl eval ENGINE_DIR``: a built engine scored against its source checkpoint."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llmctl.cli.app import build_app
from llmctl.engines.manifest import NotAnEngineError
from llmctl.eval.candidates import HFCandidate, open_candidate
from llmctl.eval.engine_candidates import EngineCandidate
from tests.engines.conftest import (
    incompatible_copy,
    onnx_fp32,  # noqa: F401 - the session fixture, reused
)

runner = CliRunner()


def _eval(*args: str):
    return runner.invoke(build_app(), ["eval", *args])


def test_plain_path_and_engine_prefix_open_the_engine(onnx_fp32, tiny_llama):  # noqa: F811
    assert EngineCandidate.matches(str(onnx_fp32))
    assert not EngineCandidate.matches(str(tiny_llama))
    assert isinstance(open_candidate(str(tiny_llama)), HFCandidate)
    for spec in (str(onnx_fp32), f"engine:{onnx_fp32}"):
        candidate = open_candidate(spec)
        assert isinstance(candidate, EngineCandidate)
        assert candidate.vocab_size == 512
        info = candidate.describe()
        assert info["target"] == "onnx" and info["precision"] == "fp32"
        assert info["provider"] == "CPUExecutionProvider"
    with pytest.raises(NotAnEngineError, match="build-engine"):
        open_candidate(f"engine:{tiny_llama}")


def test_fp32_onnx_engine_matches_its_source(onnx_fp32, tiny_llama, eval_cache,  # noqa: F811
                                             tmp_path):
    report_path = tmp_path / "report.json"
    result = _eval(str(onnx_fp32), "--reference", str(tiny_llama), "--ctx", "48",
                   "--max-windows", "2", "--top-k", "16", "--cache-dir", str(eval_cache),
                   "--threads", "1", "--gate", "mean_kld<=1e-4", "-o", str(report_path))
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    m = report["metrics"]
    assert report["metadata"]["candidate"]["kind"] == "engine"
    assert report["metadata"]["candidate"]["source"] == str(tiny_llama)
    # rounding can make the lumped top-k estimate a hair negative
    assert abs(m["mean_kld"]) < 1e-4 and m["same_top_p"] == 1.0
    assert m["ppl"] == pytest.approx(report["reference_metrics"]["ppl"], rel=1e-4)


def test_eval_refuses_an_engine_built_for_another_machine(onnx_fp32, tiny_llama,  # noqa: F811
                                                           eval_cache, tmp_path):
    copy = incompatible_copy(onnx_fp32, tmp_path)
    result = _eval(str(copy), "--data", "builtin:pydoc-heldout", "--ctx", "48",
                   "--max-windows", "1", "--cache-dir", str(eval_cache))
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[0].startswith("error: this onnx engine cannot load here"), result.output
    assert len(lines) == 2 and "hint: rebuild it on this machine" in lines[1]
