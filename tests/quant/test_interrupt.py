"""An interrupted run never leaves a directory that looks like a finished checkpoint."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmctl.quant.pipeline import LayerQuantizer
from tests.quant.conftest import RECIPES, run_quantize


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_exception_mid_run_leaves_nothing(tiny_llama, tmp_path, monkeypatch, exc):
    original = LayerQuantizer._layer

    def failing(self, i, X, writer):
        if i == 1:
            raise exc("stop")
        return original(self, i, X, writer)

    monkeypatch.setattr(LayerQuantizer, "_layer", failing)
    out = tmp_path / "out"
    with pytest.raises(exc):
        run_quantize(tiny_llama, RECIPES / "w4a16-rtn.yaml", out)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # the temporary directory is gone too


def test_failed_overwrite_keeps_the_previous_output(tiny_llama, tmp_path, monkeypatch):
    out = tmp_path / "out"
    run_quantize(tiny_llama, RECIPES / "w4a16-rtn.yaml", out)
    before = (out / "llmctl-quant.json").read_text()

    def failing(self, i, X, writer):
        raise KeyboardInterrupt

    monkeypatch.setattr(LayerQuantizer, "_layer", failing)
    with pytest.raises(KeyboardInterrupt):
        run_quantize(tiny_llama, RECIPES / "w4a16-gptq.yaml", out, overwrite=True)
    assert (out / "llmctl-quant.json").read_text() == before


KILL_SCRIPT = """
import sys, time
from pathlib import Path
from llmctl.quant.pipeline import LayerQuantizer
from tests.quant.conftest import RECIPES, run_quantize
original = LayerQuantizer._layer
def slow(self, i, X, writer):
    original(self, i, X, writer)
    print("LAYER", i, flush=True)
    time.sleep(60)
LayerQuantizer._layer = slow
run_quantize(Path(sys.argv[1]), RECIPES / "w4a16-rtn.yaml", Path(sys.argv[2]))
"""


def test_sigkill_mid_run_leaves_only_a_hidden_temporary(tiny_llama, tmp_path):
    out = tmp_path / "out"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(tiny_llama), str(out)],
                            stdout=subprocess.PIPE, text=True, cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)})
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            line = proc.stdout.readline()
            if line.startswith("LAYER") or not line:
                break
        assert line.startswith("LAYER")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not out.exists()
    leftovers = list(tmp_path.iterdir())
    assert all(p.name.startswith(".out.tmp-") for p in leftovers)
    assert not any((p / "config.json").exists() or (p / "llmctl-quant.json").exists()
                   for p in leftovers)
