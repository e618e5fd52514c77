"""Bad command-line values are usage errors: exit 2, one error line that names the option
(and what it takes) plus one hint, no traceback; nothing runs. Also the hand-off engines:
secrets redacted in the logged command, unsupported options refused, dtype forwarded."""

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from llmctl.cli.app import build_app

runner = CliRunner()
app = build_app()
DOWN = "http://127.0.0.1:9"  # never contacted: the command line fails first


def run(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


def assert_usage_error(result, option: str, *expected: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 2, result.output  # the error and its hint
    assert lines[0].startswith("error: ") and option in lines[0], result.output
    assert lines[1].strip().startswith("hint:"), result.output
    for text in expected:
        assert text in lines[0], result.output
    assert "Traceback" not in result.output and "unexpected error" not in result.output


@pytest.fixture
def no_cuda(monkeypatch):
    from llmctl.utils import device

    monkeypatch.setattr(device, "cuda_available", lambda: False)


@pytest.mark.parametrize("args,option,expected", [
    (["bench", "--target", DOWN, "--burstiness", "0"], "--burstiness", ["greater than 0"]),
    (["bench", "--target", DOWN, "--duration", "0"], "--duration", ["greater than 0"]),
    (["bench", "--target", DOWN, "--request-timeout", "0"], "--request-timeout",
     ["greater than 0"]),
    (["bench", "--target", DOWN, "--num-prompts", "0"], "--num-prompts", ["1"]),
    (["build-engine", "m", "-t", "onnx", "-o", "out", "--device", "gpu"], "--device",
     ["'cpu', 'cuda'"]),
    (["build-engine", "m", "-t", "onnx", "-o", "out", "--max-batch-size", "5000"],
     "--max-batch-size", ["less than or equal to 4096", "5000"]),
    (["quantize", "m", "-r", "w4a16-rtn", "-o", "out", "--device", "cuda"], "--device cuda",
     ["CUDA is not available"]),
    (["quantize", "m", "-r", "w4a16-rtn", "-o", "out", "--threads", "-1"], "--threads",
     ["greater than or equal to 1"]),
    (["serve", "m", "--log-level", "foo"], "--log-level", ["'debug'", "'critical'"]),
    (["serve", "m", "--dtype", "float64"], "--dtype", ["'auto'", "'bfloat16'"]),
    (["serve", "m", "--engine", "trtllm", "--api-key", "K"], "--api-key", ["trtllm"]),
    (["serve", "m", "--engine", "trtllm", "--served-model-name", "x"], "--served-model-name",
     ["trtllm"]),
    (["serve", "m", "--replicas", "0"], "--replicas", ["1"]),
    (["serve", "m", "--replicas", "4096"], "--replicas 4096", ["CPUs"]),
    (["serve", "m", "--no-engine-process", "--replicas", "2"], "--replicas",
     ["--no-engine-process"]),
    (["serve", "m", "--max-rss", "0.5"], "--max-rss", ["size"]),
    (["serve", "m", "--engine-nice", "25"], "--engine-nice", ["0..19"]),
    (["serve", "m", "--no-engine-process", "--engine-nice", "5"], "--engine-nice",
     ["--no-engine-process"]),
    (["serve", "m", "--engine-step-timeout", "0"], "--engine-step-timeout", ["0.001"]),
    (["serve", "m", "--engine", "vllm", "--replicas", "2"], "--replicas", ["vllm"]),
    (["generate", "m", "-p", "x", "--top-p", "0"], "--top-p", ["0 < top_p <= 1"]),
    (["generate", "m", "-p", "x", "--top-p", "1.5"], "--top-p", ["0 < top_p <= 1"]),
    (["eval", "m", "--ctx", "16", "--stride", "32"], "stride", ["larger than ctx"]),
])
def test_bad_values_are_usage_errors(no_cuda, args, option, expected):
    assert_usage_error(run(*args), option, *expected)


def test_trtllm_refuses_an_api_key_from_the_environment():
    result = run("serve", "m", "--engine", "trtllm", env={"LLMCTL_API_KEY": "K"})
    assert_usage_error(result, "--api-key", "trtllm")


def _report(path, **metrics):
    path.write_text(json.dumps({"completed": 8, "failed": 0, **metrics}))
    return path


def test_compare_gate_on_an_unknown_metric_is_a_usage_error(tmp_path):
    a = _report(tmp_path / "a.json", output_throughput=10.0)
    b = _report(tmp_path / "b.json", output_throughput=11.0)
    assert_usage_error(run("bench", "compare", a, b, "--gate", "date<=1"), "'date'")
    assert run("bench", "compare", a, b, "--gate", "output_throughput>=0.95*reference"
               ).exit_code == 0
    failed = run("bench", "compare", a, b, "--gate", "output_throughput>=2*reference")
    assert failed.exit_code == 1 and "FAIL" in failed.output


def test_typer_usage_errors_print_like_every_other_error():
    assert_usage_error(run("bench", "compare"), "reports")  # missing argument
    assert_usage_error(run("generate", "m"), "--prompt")  # missing option
    assert_usage_error(run("nosuch"), "nosuch")


class Handoff:
    def __init__(self, monkeypatch):
        from llmctl.serve.handoff import engines as handoff

        self.commands = []
        monkeypatch.setattr(handoff, "run_handoff", lambda cmd: self.commands.append(cmd) or 0)


def test_vllm_handoff_logs_the_command_without_the_key(tiny_llama, tmp_path, monkeypatch):
    handoff = Handoff(monkeypatch)
    python = tmp_path / "python"
    python.write_text("")
    result = run("serve", tiny_llama, "--engine", "vllm", "--engine-python", python,
                 "--api-key", "sk-secret", "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    [cmd] = handoff.commands
    assert cmd[cmd.index("--api-key") + 1] == "sk-secret"  # the engine gets the key...
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert "sk-secret" not in result.output  # ...the log does not
    assert "--api-key ***" in result.output and "starting:" in result.output


def test_trtllm_handoff_forwards_dtype_as_an_llm_api_option(tiny_llama, monkeypatch):
    handoff = Handoff(monkeypatch)
    monkeypatch.setattr("shutil.which", lambda name: f"/opt/trt/bin/{name}")
    result = run("serve", tiny_llama, "--engine", "trtllm", "--dtype", "float16",
                 "--max-model-len", "512")
    assert result.exit_code == 0, result.output
    [cmd] = handoff.commands
    assert cmd[:2] == ["/opt/trt/bin/trtllm-serve", str(tiny_llama)]
    options = yaml.safe_load(Path(cmd[cmd.index("--extra_llm_api_options") + 1]).read_text())
    assert options == {"dtype": "float16"}
    assert cmd[cmd.index("--max_seq_len") + 1] == "512"
    default = run("serve", tiny_llama, "--engine", "trtllm")  # auto: trtllm-serve decides
    assert default.exit_code == 0 and "--extra_llm_api_options" not in handoff.commands[1]
