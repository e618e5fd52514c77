"""scripts/device-check end to end on this CPU: ``prepare`` (model files only: no
download in a test) then ``dry-run``, whose report must have the shape the GPU run's
has: the device, the commit, the gpu tests (collected, every one skipped with its
reason here), and the quick benchmark's decode and GPTQ sections."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "device-check"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)


def test_prepare_then_dry_run_writes_the_report(tiny_llama, tmp_path):
    carry, out = tmp_path / "carry", tmp_path / "out"
    done = _run("prepare", "--dest", str(carry), "--model", str(tiny_llama), "--skip-wheels")
    assert done.returncode == 0, done.stdout + done.stderr
    manifest = json.loads((carry / "manifest.json").read_text())
    assert manifest["wheels"] == [] and "config.json" in manifest["model"]["files"]
    assert not list((carry / "models" / "bench").glob("*.safetensors"))  # no weights carried
    assert manifest["carry_bytes"] + manifest["tree_bytes"] < 64 * 2**20

    done = _run("dry-run", "--carry", str(carry), "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert {"device-check.json", "device-check.md", "pytest.log", "bench.json"} <= {
        p.name for p in out.iterdir()}
    assert len(list(out.iterdir())) <= 8  # what the device tool brings back
    report = json.loads((out / "device-check.json").read_text())
    assert report["schema"] == "llmctl-device-check/1" and report["mode"] == "dry-run"
    assert len(report["git"]["commit"]) == 40
    # the files' tree hash, as git computes it for a commit of exactly these files
    assert len(report["git"]["tree"]) == 40
    assert {"torch", "cuda_available", "driver"} <= report["device"].keys()
    assert report["wheels"]["status"] == "skipped"
    tests = report["tests"]
    assert tests["status"] == "passed" and tests["failed"] == tests["errors"] == 0
    assert tests["skipped"] >= 20 and tests["passed"] == 0  # collected, all skipped here
    assert all("CUDA" in reason for reason in tests["skip_reasons"])
    bench = report["bench"]
    assert bench["status"] == "ok"
    decode = bench["results"]["decode"]
    assert decode["status"] == "ok"
    for key in ("engine_b1", "transformers_b1", "engine_b4", "transformers_b4"):
        row = decode["results"][key]
        assert row["decode_tokens_per_s"] > 0 and {"mfu", "mbu"} <= row.keys()
    gptq = bench["results"]["gptq"]
    assert gptq["status"] == "ok" and len(gptq["linears"]) == 7
    md = (out / "device-check.md").read_text()
    assert md.startswith("# llmctl device check") and "## gpu tests" in md and "| engine |" in md
