"""The README's demo (`make demo`), end to end through the installed console script:
quantize the embedded model with GPTQ W4, gate its quality, chat with the result."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_quantizes_gates_and_answers(smollm2, tmp_path):
    venv = Path(sys.executable).parent.parent  # the venv running the tests
    run = subprocess.run(["make", "-s", "demo", f"VENV={venv}", f"DEMO_DIR={tmp_path}"],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "134,515,008" in run.stdout  # llmctl info
    meta = json.loads((tmp_path / "smollm2-w4a16" / "llmctl-quant.json").read_text())
    assert meta["method"] == "gptq"
    config = json.loads((tmp_path / "smollm2-w4a16" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    report = json.loads((tmp_path / "eval.json").read_text())
    assert all(g["passed"] for g in report["gates"]), report["gates"]
    assert 1.0 < report["metrics"]["ppl_ratio"] <= 1.40
    # The quality verdict is the eval gates above. The chat answer is checked for being on
    # topic, not for "Paris": SmolLM2 is precision-sensitive on this prompt, and the W4
    # checkpoint's bf16 answer differs by CPU (an Intel AMX Xeon: "The capital of France is
    # not a country, but ..."; AMD Zen 4/5: "Paris"). A broken checkpoint answers neither.
    answer = run.stdout.strip().splitlines()[-1]
    assert "Paris" in answer or "France" in answer, run.stdout[-400:]
