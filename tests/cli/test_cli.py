import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from llmctl.cli.app import build_app

runner = CliRunner()
app = build_app()


def run(*args, env=None):
    return runner.invoke(app, list(args), env=env)


def test_help_does_not_import_torch():
    code = ("import sys; from llmctl.cli.app import build_app; build_app(); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_help_lists_every_command():
    result = run("--help")
    assert result.exit_code == 0
    for name in ("info", "generate", "quantize", "build-engine", "serve", "bench", "eval"):
        assert name in result.output


@pytest.mark.parametrize("command", ["info", "generate", "quantize", "build-engine", "serve",
                                     "bench", "eval"])
def test_every_command_answers_help(command):
    result = run(command, "--help")
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def test_info_json(tiny_llama):
    result = run("info", str(tiny_llama), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["layers"] == 2 and data["vocab_size"] == 512 and data["source"] == "local"


def test_info_human(tiny_llama):
    result = run("info", str(tiny_llama))
    assert result.exit_code == 0
    assert "LlamaForCausalLM" in result.output and "parameters" in result.output


def test_info_of_a_gguf_shows_metadata_and_tensors(tiny_gguf):
    result = run("info", str(tiny_gguf), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["metadata"]["general.architecture"] == "llama"
    assert data["metadata"]["llama.block_count"] == 2
    assert len(data["tensors"]) == 3 + 2 * 9
    assert data["bits_per_weight"] == pytest.approx(32.0)
    human = run("info", str(tiny_gguf), "--tensors")
    assert "blk.1.ffn_down.weight" in human.output


def test_generate_equals_transformers_greedy(tiny_llama):
    from llmctl.models.hf_generate import hf_generate
    from llmctl.models.loading import load_model, load_tokenizer

    tok = load_tokenizer(tiny_llama)
    ids = tok("The file object")["input_ids"]
    expected = hf_generate(load_model(tiny_llama), tok, ids, max_tokens=12)
    result = run("generate", str(tiny_llama), "--prompt", "The file object", "--max-tokens",
                 "12", "--dtype", "float32", "--json")  # exact tokens: float32 only
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["dtype"] == "float32" and data["dtype_reason"] == "as requested"
    assert data["token_ids"] == expected
    assert data["completion_tokens"] == len(expected)


@pytest.mark.parametrize("make_input,expected", [
    (lambda p: str(p / "missing"), "no model at"),
    (lambda p: str(p), "not a model directory"),
    (lambda p: (p / "config.json").write_text('{"model_type": "bert"}') and str(p),
     "'bert' is not supported"),
    (lambda p: (p / "bad.gguf").write_bytes(b"GGUF\x00junk") and str(p / "bad.gguf"),
     "cannot read"),
])
def test_bad_model_references_give_one_line_errors(tmp_path, make_input, expected):
    result = run("info", make_input(tmp_path))
    assert result.exit_code == 1
    assert expected in result.output
    assert "hint:" in result.output
    assert "Traceback" not in result.output


def test_hub_offline_error(tmp_path):
    result = run("info", "nosuchorg/nosuchmodel",
                 env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)})
    assert result.exit_code == 1
    assert "not reachable" in result.output


def test_usage_errors_exit_2(tiny_llama):
    result = run("generate", str(tiny_llama), "--prompt", "x", "--max-tokens", "0")
    assert result.exit_code == 2


def test_debug_env_shows_the_real_exception(tmp_path):
    result = run("info", str(tmp_path / "missing"), env={"LLMCTL_DEBUG": "1"})
    assert result.exit_code == 1
    assert type(result.exception).__name__ == "ModelNotFoundError"


def test_chat_without_template_is_a_usage_error(tiny_llama, tmp_path):
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(tiny_llama, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    result = run("generate", str(plain), "--prompt", "x", "--chat")
    assert result.exit_code == 2
    assert "no chat template" in result.output


@pytest.fixture
def fake_cpu(monkeypatch):
    """A CPU-only machine whose flags the test chooses."""
    from llmctl.utils import device

    monkeypatch.setattr(device, "cuda_available", lambda: False)

    def with_flags(*flags):
        monkeypatch.setattr(device, "cpu_flags", lambda: frozenset(flags))

    return with_flags


@pytest.mark.parametrize("flags,dtype,line", [
    (("avx2", "avx512_bf16"), "bfloat16", "dtype auto -> bfloat16 (CPU has AVX512-BF16)"),
    (("avx2",), "float32", "dtype auto -> float32 (CPU without native bfloat16)"),
])
def test_generate_defaults_to_dtype_auto_and_says_why(tiny_llama, fake_cpu, flags, dtype, line):
    fake_cpu(*flags)
    result = run("generate", str(tiny_llama), "--prompt", "The file object", "--max-tokens",
                 "2")
    assert result.exit_code == 0, result.output
    assert line in result.output
    data = json.loads(run("generate", str(tiny_llama), "--prompt", "x", "--max-tokens", "1",
                          "--json").stdout)
    assert data["dtype"] == dtype


def test_serve_resolves_dtype_auto_once_and_logs_it(tiny_llama, fake_cpu, monkeypatch, caplog):
    import logging

    from llmctl.serve.launch import assemble as launch

    seen = []
    monkeypatch.setattr(launch, "run_server", lambda opts, ready=None: seen.append(opts) or 0)
    fake_cpu("amx_tile", "amx_bf16")
    with caplog.at_level(logging.INFO, logger="llmctl.serve"):
        assert run("serve", str(tiny_llama)).exit_code == 0
        assert run("serve", str(tiny_llama), "--dtype", "float32").exit_code == 0
    assert [o.engine_kwargs["dtype"] for o in seen] == ["bfloat16", "float32"]
    assert "dtype auto -> bfloat16 (CPU has AMX-BF16)" in caplog.messages
    assert "dtype float32 (as requested)" in caplog.messages


def test_serve_engine_settings_are_checked_before_loading(tiny_llama, monkeypatch):
    from llmctl.serve.launch import assemble as launch

    monkeypatch.setattr(launch, "run_server", lambda opts, ready=None: pytest.fail("ran"))
    result = run("serve", str(tiny_llama), "--speculative", "draft")  # no --draft-model
    assert result.exit_code == 2, result.output
    assert "draft_model" in result.output and "Traceback" not in result.output
