"""The README's demo, end to end through the installed console script."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_console_script_info_and_answer(smollm2):
    exe = Path(sys.executable).parent / "llmctl"
    cmd = [str(exe)] if exe.exists() else [shutil.which("llmctl") or "llmctl"]
    info = subprocess.run(cmd + ["info", "smollm2-135m"], capture_output=True, text=True)
    assert info.returncode == 0, info.stderr
    assert "134,515,008" in info.stdout
    answer = subprocess.run(cmd + ["generate", "smollm2-135m", "--chat", "--max-tokens", "24",
                                   "--prompt", "What is the capital of France?"],
                            capture_output=True, text=True)
    assert answer.returncode == 0, answer.stderr
    assert "Paris" in answer.stdout
