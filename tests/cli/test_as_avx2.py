"""The CLI as an AVX2-only CPU (AMD Zen 3) runs it, on whatever x86 machine runs the suite.

``benchmarks/as_avx2`` caps llmctl's flag reading, its kernel build and torch's own kernels
at AVX2 (see its header). On an AVX-512 CI machine this is the only place the Zen 3
decisions run end to end: ``--dtype auto`` picks float32, bf16 is computed by the widening
kernels (oneDNN refuses to pack bf16 there: the crash of issue 31), and ``hw show`` names
the avx2 build. Each run is a subprocess: torch reads its caps at import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmctl.serve.kernels.cpu import supported_variants

ROOT = Path(__file__).resolve().parents[2]
AS_AVX2 = ROOT / "benchmarks" / "as_avx2"
LLMCTL = [sys.executable, "-m", "llmctl"]

pytestmark = pytest.mark.skipif("avx2" not in supported_variants(),
                                reason="this CPU cannot run AVX2 code (not x86-64-v3)")


def as_avx2(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LLMCTL_KERNEL_ISA"}
    return subprocess.run([str(AS_AVX2), *LLMCTL, *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)


def test_dtype_auto_is_float32_and_matches_transformers(tiny_llama):
    from llmctl.models.hf_generate import hf_generate
    from llmctl.models.loading import load_model, load_tokenizer

    tok = load_tokenizer(tiny_llama)
    expected = hf_generate(load_model(tiny_llama), tok, tok("The file object")["input_ids"],
                           max_tokens=8)
    proc = as_avx2("generate", str(tiny_llama), "--prompt", "The file object",
                   "--max-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert (data["dtype"], data["dtype_reason"]) == ("float32", "CPU without native bfloat16")
    assert data["token_ids"] == expected  # float32: exact tokens


def test_bfloat16_runs_on_the_widening_kernels(tiny_llama):
    proc = as_avx2("generate", str(tiny_llama), "--prompt", "The file object",
                   "--max-tokens", "8", "--dtype", "bfloat16", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["dtype"] == "bfloat16" and data["completion_tokens"] == 8


def test_hw_show_names_the_avx2_build(tmp_path):
    proc = as_avx2("hw", "show")  # no probe cached in this session's home: exit 1
    out = proc.stdout + proc.stderr  # the kernels line is on stderr beside the error
    assert "engine kernels: avx2 bodies" in out, out
    assert "this CPU runs avx2, portable" in out and "(avx2, no amx)" in out
