import json

from typer.testing import CliRunner

from llmctl.cli.app import build_app
from tests.engines.conftest import _need_onnx

runner = CliRunner()
app = build_app()


def run(*args):
    return runner.invoke(app, list(args))


def test_build_onnx_json(tiny_llama, tmp_path):
    _need_onnx()
    out = tmp_path / "eng"
    result = run("build-engine", str(tiny_llama), "--target", "onnx", "-o", str(out),
                 "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["target"] == "onnx" and data["precision"] == "fp32"
    assert data["serve_command"] == f"llmctl serve {out}"
    assert data["requirements"]["execution_provider"] == "CPUExecutionProvider"
    assert (out / "llmctl-engine.json").is_file() and (out / "model.onnx").is_file()
    again = run("build-engine", str(tiny_llama), "--target", "onnx", "-o", str(out))
    assert again.exit_code == 1 and "already exists" in again.output
    assert "--overwrite" in again.output


def test_build_tensorrt_llm_human_output(tiny_llama, tmp_path):
    out = tmp_path / "trt"
    result = run("build-engine", str(tiny_llama), "-t", "tensorrt-llm", "-o", str(out),
                 "-O", "speculative=ngram", "-O", "max-draft-len=3")
    assert result.exit_code == 0, result.output
    assert "tensorrt-llm engine (auto)" in result.output
    assert "trtllm-serve ./checkpoint" in result.output
    assert "max_draft_len: 3" in (out / "extra_llm_api_options.yaml").read_text()


def test_usage_errors_are_one_line(tiny_llama, tmp_path):
    cases = [
        (["-t", "tensorrt"], 2, "unknown target 'tensorrt'", "onnx, torch-compile"),
        (["-t", "onnx", "--precision", "fp16"], 2, "built for cuda, not cpu", "fp16 needs"),
        (["-t", "onnx", "-O", "block_size=48"], 1, "block_size must be 16, 32", "options of"),
        (["-t", "onnx", "-O", "blocksize"], 2, "is not KEY=VALUE", "--option key=value"),
        (["-t", "torch-compile", "-O", "isa=armv9"], 1, "invalid options", "isa"),
    ]
    for extra, code, message, hint in cases:
        result = run("build-engine", str(tiny_llama), "-o", str(tmp_path / "x"), *extra)
        assert result.exit_code == code, (extra, result.output)
        assert message in result.output and hint in result.output, result.output
        assert "Traceback" not in result.output
    assert not (tmp_path / "x").exists()
