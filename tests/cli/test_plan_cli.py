"""``llmctl plan`` end to end: the embedded model, a config directory, JSON, exit codes."""

import json

import pytest
from typer.testing import CliRunner

from llmctl.cli.app import build_app
from llmctl.perf.peaks import Peaks
from tests.perf.test_costs import LLAMA3_70B, SMOL_W4

runner = CliRunner()
app = build_app()


def run(*args):
    return runner.invoke(app, ["plan", *map(str, args)])


def one_line_usage_error(result, *expected: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 2 and lines[0].startswith("error: "), result.output
    assert lines[1].strip().startswith("hint:"), result.output
    for text in expected:
        assert text in result.output, result.output
    assert "Traceback" not in result.output


@pytest.fixture
def smol_w4_dir(tmp_path):
    """A config directory like `llmctl quantize`'s SmolLM2 W4A16 output, without weights."""
    cfg = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
           "vocab_size": 49152, "head_dim": 64, "tie_word_embeddings": True,
           "max_position_embeddings": 8192, "torch_dtype": "float32",
           "quantization_config": SMOL_W4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_embedded_model_as_json():
    result = run("smollm2-135m", "--hardware", "h100-80gb", "--context", "2048", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {"model", "weights", "hardware", "memory", "ttft", "decode", "efficiency", "fits",
            "ok", "suggestions", "notes", "config_source"} <= data.keys()
    assert data["model"]["total_params"] == pytest.approx(134.5e6, rel=0.001)
    assert data["weights"]["name"] == "bf16"  # the GGUF's float checkpoint, served in bf16
    assert data["memory"]["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2  # 23040
    assert data["decode"][0]["batch"] == 1 and data["decode"][-1]["batch"] == 256
    assert {"tpot_ms", "bound", "compute_ms", "memory_ms", "estimate_ms"} <= data["decode"][0].keys()
    assert "GGUF" in data["config_source"]


def test_config_dir_reads_the_quantization_config(smol_w4_dir):
    result = run(smol_w4_dir, "-H", "l4", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["weights"]["name"] == "w4a16-g64"
    # 106.2M linear weights at 4.25 bits + the tied 16-bit table + norms
    assert data["model"]["weight_bytes"] == pytest.approx(113.1e6, rel=0.001)
    over = json.loads(run(smol_w4_dir, "-H", "l4", "--weights", "bf16", "--json").stdout)
    assert over["weights"]["name"] == "bf16"
    assert any("replaces the checkpoint's quantization_config" in n for n in over["notes"])


def test_human_output_and_exit_1_when_it_does_not_fit(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_70B))
    result = run(tmp_path / "config.json", "-H", "h100-sxm", "--slo", "p95_tpot_ms<=50")
    assert result.exit_code == 1, result.output
    out = result.output
    assert "does not fit" in out and "Memory per device" in out
    assert "--tp 2: weights 141.1 GB -> 70.6 GB per GPU" in out
    assert "--weights w4a16" in out
    fits = run(tmp_path, "-H", "h100-sxm", "--tp", "4")
    assert fits.exit_code == 0, fits.output
    assert "fits" in fits.output and "all-reduces" in fits.output


@pytest.mark.parametrize("args,expected", [
    (["-H", "h99"], ["unknown hardware 'h99'", "h100-80gb"]),
    (["-H", "h100-80gb", "--weights", "w3"], ["unknown weight format 'w3'"]),
    (["-H", "h100-80gb", "--tp", "0"], ["--tp"]),
    (["-H", "h100-80gb", "--context", "0"], ["--context"]),
    (["-H", "h100-80gb", "--slo", "p95_ttft<=500"], ["cannot read SLO"]),
    (["-H", "h100-80gb", "--prompt-len", "9000"], ["prompt_len must be in 1..context"]),
])
def test_bad_values_exit_2_with_one_line(args, expected):
    one_line_usage_error(run("smollm2-135m", *args), *expected)


def test_a_tp_that_does_not_divide_the_heads_exits_2(smol_w4_dir):
    one_line_usage_error(run(smol_w4_dir, "-H", "h100-80gb", "--tp", "2"),
                         "tp 2 does not divide the 9 attention heads")


def test_hardware_this_uses_the_probed_peaks(monkeypatch, smol_w4_dir):
    from llmctl.perf import probe_record

    monkeypatch.setattr(probe_record, "cached_peaks",
                        lambda: Peaks({"bf16": 4.4e11, "fp32": 2.2e11}, 3.5e10,
                                      "probe: test cpu, 2 threads", 8 * 2**30))
    result = run(smol_w4_dir, "-H", "this", "--context", "96", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["hardware"]["source"] == "probe: test cpu, 2 threads"
    assert data["efficiency"]["overlap"] is False and data["efficiency"]["per_layer_us"] == 58
    step = data["decode"][0]
    assert step["estimate_ms"] == pytest.approx(step["compute_ms"] + step["memory_ms"] + 1.74)
    # an override replaces the probed value and says so
    over = json.loads(run(smol_w4_dir, "-H", "this", "--peak-bandwidth", "7e10",
                          "--overhead-us-per-layer", "0", "--json").stdout)
    assert over["peak_bandwidth"] == 7e10 and "override: 7e+10 B/s" in over["hardware"]["source"]
    assert over["decode"][0]["overhead_ms"] == 0


def test_hardware_this_without_a_probe_exits_2(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMCTL_HOME", str(tmp_path))  # an empty cache: nothing probed
    one_line_usage_error(run("smollm2-135m", "-H", "this"), "run `llmctl hw probe` first")


def test_a_missing_model_is_one_line(tmp_path):
    result = run(tmp_path, "-H", "h100-80gb")
    assert result.exit_code == 1 and "has no config.json" in result.output
