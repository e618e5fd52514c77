"""``llmctl quantize`` through Typer's CliRunner."""

import json
import sys

from typer.testing import CliRunner

from llmctl.cli.app import build_app
from tests.quant.conftest import write_recipe

runner = CliRunner()
app = build_app()


def run(*args):
    return runner.invoke(app, ["quantize", *map(str, args)])


def test_dry_run_prints_plan_as_json(tiny_llama):
    result = run(tiny_llama, "-r", "w4a16-gptq", "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["dry_run"] is True
    modules = {m["name"]: m for m in data["plan"]["modules"]}
    assert modules["model.layers.0.self_attn.q_proj"]["weight"] == "int4 sym g64"
    assert modules["model.layers.0.mlp.down_proj"]["weight"] == "int4 sym g128"
    assert modules["lm_head"]["weight"] is None
    assert data["plan"]["bytes_after"] < data["plan"]["bytes_before"]
    assert data["memory_estimate"]["needed_bytes"] > 0


def test_dry_run_table_mentions_expected_size(tiny_llama):
    result = run(tiny_llama, "-r", "w8a8-fp8-dynamic", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "expected size" in result.stdout and "float-quantized" in result.stdout


def test_quantize_writes_checkpoint_then_refuses_to_overwrite(tiny_llama, tmp_path):
    out = tmp_path / "q"
    args = [tiny_llama, "-r", "w4a16-rtn", "-o", out, "--samples", "4", "--seq-len", "32",
            "--calib-dtype", "float32"]
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["method"] == "rtn" and data["format"] == "pack-quantized"
    assert (out / "llmctl-quant.json").is_file()
    again = run(*args)
    assert again.exit_code == 1
    assert "already exists" in again.output and "--overwrite" in again.output
    assert run(*args, "--overwrite", "--json").exit_code == 0


def test_recipe_typo_is_one_line_with_allowed_keys(tiny_llama, tmp_path):
    recipe = write_recipe(tmp_path / "typo.yaml", """
quant_stage:
  quant_modifiers:
    GPTQModifier: {scheme: W4A16, dampening: 0.1}
""")
    result = run(tiny_llama, "-r", recipe, "-o", tmp_path / "o")
    assert result.exit_code == 1
    assert "unknown recipe key 'dampening'" in result.output and "dampening_frac" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "o").exists()


def test_missing_recipe_is_a_usage_error(tiny_llama):
    result = run(tiny_llama, "-o", "x")
    assert result.exit_code == 2 and "--recipe" in result.output


def test_strict_group_size_names_layer_and_valid_sizes(tiny_llama):
    result = run(tiny_llama, "-r", "w4a16-gptq", "--dry-run", "--strict-group-size")
    assert result.exit_code == 1
    assert "self_attn.q_proj" in result.output and "16, 32, 64" in result.output


def test_gguf_dispatches_to_the_gguf_exporter(tiny_llama, tmp_path, monkeypatch):
    from llmctl.gguf import export

    seen = {}

    def fake(model_dir, out_path, gguf_type=None, recipe_overrides=None, imatrix=None,
             calibration=None, progress=None, *, dry_run=False, threads=None):
        seen.update(model_dir=model_dir, out_path=out_path, gguf_type=gguf_type, dry_run=dry_run)
        return {"path": str(out_path), "type": gguf_type}

    monkeypatch.setattr(export, "quantize_to_gguf", fake)
    result = run(tiny_llama, "--format", "gguf", "--type", "Q8_0", "-o", tmp_path / "m.gguf", "--json")
    assert result.exit_code == 0, result.output
    assert seen["gguf_type"] == "Q8_0" and seen["out_path"].name == "m.gguf"
    assert json.loads(result.stdout)["type"] == "Q8_0"


def test_gguf_without_exporter_is_not_available_yet(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llmctl.gguf.export", None)  # import fails
    result = run(tiny_llama, "--format", "gguf", "-o", tmp_path / "m.gguf")
    assert result.exit_code == 2 and "not available yet" in result.output


def test_unknown_format(tiny_llama):
    result = run(tiny_llama, "--format", "onnx", "-r", "w4a16-rtn")
    assert result.exit_code == 2 and "compressed-tensors or gguf" in result.output


def test_human_report_says_what_data_a_run_read(tiny_llama, tmp_path):
    """Round-to-nearest is data-free (no calibration line counts tokens); GPTQ reads its
    samples x seq_len tokens; the dry run says so before any work. The calibration dtype
    defaults to auto: float32 on a CPU without native bf16."""
    from llmctl.utils.device import resolve_calib_dtype

    rtn = run(tiny_llama, "-r", "w4a16-rtn", "-o", tmp_path / "rtn")
    assert rtn.exit_code == 0, rtn.output
    assert "calibration: none (round-to-nearest from the weights alone)" in rtn.output
    assert "(no calibration, cpu)" in " ".join(rtn.output.split())
    gptq = run(tiny_llama, "-r", "w4a16-gptq", "-o", tmp_path / "gptq", "--samples", "4",
               "--seq-len", "32", "--json")
    assert gptq.exit_code == 0, gptq.output
    data = json.loads(gptq.stdout)
    assert data["calibration"]["tokens"] == 128
    assert data["compute_dtype"] == resolve_calib_dtype("auto", device="cpu").dtype
    dry = run(tiny_llama, "-r", "w4a16-rtn", "--dry-run", "--json")
    assert json.loads(dry.stdout)["calibration"]["data_free"] is True
    assert run(tiny_llama, "-r", "w4a16-rtn", "--dry-run", "--calib-dtype", "fp16").exit_code == 2
