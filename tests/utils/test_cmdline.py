"""Secrets never reach a log line or a report."""

import sys

from llmctl.utils import cmdline


def test_redact_both_spellings_and_nothing_else():
    argv = ["vllm", "--model", "m", "--api-key", "sk-1", "--port", "1", "--api-key=sk-2"]
    assert cmdline.redact(argv) == ["vllm", "--model", "m", "--api-key", "***", "--port", "1",
                                    "--api-key=***"]
    assert cmdline.shown(argv) == "vllm --model m --api-key *** --port 1 --api-key=***"
    assert cmdline.redact(["--api-key"]) == ["--api-key"]  # nothing to hide yet


def test_redact_text_keeps_quoting():
    assert cmdline.redact_text("--api-key s3cret --served-model-name 'a b'") == (
        "--api-key *** --served-model-name 'a b'")
    assert "s3cret" not in cmdline.redact_text("--api-key 's3cret")  # unbalanced quote
    assert cmdline.redact_text(None) is None


def test_command_line_of_this_process(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/llmctl", "bench", "--api-key", "K", "-n", "2"])
    assert cmdline.command_line() == "llmctl bench --api-key *** -n 2"
    monkeypatch.setattr(sys, "argv", ["pytest"])
    assert cmdline.command_line() is None
