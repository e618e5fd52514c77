"""Slow: the example pipeline the CI examples run (examples/check-smollm2.yaml), on the
embedded SmolLM2-135M: W4 RTN, W4 GPTQ and W8 GPTQ quantized, served, benched and
evaluated; the ranking puts W8 first and RTN last, and the report's numbers are the
single commands' numbers for the same artifacts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from llmctl.cli.app import build_app

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "check-smollm2.yaml"
CI_FILES = (REPO / "examples" / "ci" / "github-actions.yml", REPO / "examples" / "ci" / "gitlab-ci.yml")
runner = CliRunner()
app = build_app()


def _commands(data) -> list[str]:
    """Every shell line of a CI file (GitHub `run:` blocks, GitLab `script:` lists)."""
    found = []
    if isinstance(data, dict):
        for key, value in data.items():
            if key == "run" and isinstance(value, str):
                found += value.splitlines()
            elif key == "script" and isinstance(value, list):
                found += [str(v) for v in value]
            else:
                found += _commands(value)
    elif isinstance(data, list):
        for item in data:
            found += _commands(item)
    return found


@pytest.mark.parametrize("ci", CI_FILES, ids=lambda p: p.name)
def test_ci_examples_run_the_tested_pipeline_with_a_cached_home(ci):
    from llmctl.check.pipeline import load_pipeline

    data = yaml.safe_load(ci.read_text())
    lines = " ".join(_commands(data)).replace("\\ ", " ")
    match = re.search(r"llmctl check (\S+)", lines)
    assert match and (REPO / match[1]).resolve() == EXAMPLE, lines
    assert "--junit" in lines and "make venv" in lines
    load_pipeline(EXAMPLE)  # it validates
    text = ci.read_text()
    assert "LLMCTL_HOME" in text and ".llmctl-home" in text  # the cache between runs
    assert "check-out" in text  # the report is uploaded / kept


@pytest.mark.slow
def test_example_pipeline_on_smollm2_ranks_and_matches_single_commands(smollm2, tmp_path):
    out = tmp_path / "check"
    result = runner.invoke(app, ["check", str(EXAMPLE), "-o", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    names = [e["name"] for e in report["candidates"]]
    assert names == ["w4a16-rtn", "w4a16-gptq", "w8a16-gptq"]
    order = report["ranking"]["order"]
    assert report["ranking"]["quality_metric"] == "mean_kld"
    assert order[0] == "w8a16-gptq" and order[-1] == "w4a16-rtn", order
    by_name = {e["name"]: e for e in report["candidates"]}
    for entry in report["candidates"]:
        assert entry["metrics"]["bench.chat.completed"] == 8
        assert entry["metrics"]["bench.chat.failed"] == 0

    # `llmctl eval` on the same artifact, as a user would run it: the same numbers
    gptq = by_name["w4a16-gptq"]
    single = tmp_path / "eval.json"
    result = runner.invoke(app, ["eval", gptq["path"], "--reference", "smollm2-135m",
                                 "--data", "builtin:pydoc-heldout", "--max-windows", "4",
                                 "-o", str(single)])
    assert result.exit_code == 0, result.output
    alone = json.loads(single.read_text())["metrics"]
    for key in ("ppl", "ppl_ratio", "mean_kld", "same_top_p"):
        assert gptq["metrics"][key] == alone[key], key

    # `llmctl quantize` with the same recipe and calibration: the same checkpoint bytes
    rtn = by_name["w4a16-rtn"]
    single_dir = tmp_path / "rtn"
    result = runner.invoke(app, ["quantize", "smollm2-135m", "--recipe", "w4a16-rtn",
                                 "--samples", "16", "--seq-len", "256", "-o", str(single_dir)])
    assert result.exit_code == 0, result.output
    for file in sorted(single_dir.glob("*.safetensors")):
        assert file.read_bytes() == (Path(rtn["path"]) / file.name).read_bytes(), file.name
