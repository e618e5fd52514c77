import json
import shutil

import pytest

from llmctl.engines.engine_dir import open_engine
from llmctl.engines.host import Host
from llmctl.engines.manifest import (
    MANIFEST_NAME,
    EngineIncompatibleError,
    EngineManifest,
    NotAnEngineError,
    PackageRule,
    Requirements,
    compatibility_problems,
    read_manifest,
)
from llmctl.errors import LlmctlError


def _host(**overrides) -> Host:
    base = dict(arch="x86_64", cpu="Test CPU", cores=2, flags=frozenset({"avx2", "fma"}),
                gpus=(), packages={"torch": "2.13.0+cpu", "onnxruntime": "1.31.1"})
    base.update(overrides)
    return Host(**base)


def _manifest(onnx_fp32, **requirements) -> EngineManifest:
    manifest = read_manifest(onnx_fp32)
    return manifest.model_copy(update={"requirements": Requirements(**requirements)})


def test_manifest_records_source_build_and_machine(onnx_fp32, tiny_llama):
    from llmctl.engines.source import source_sha256

    m = read_manifest(onnx_fp32)
    assert m.target == "onnx" and m.precision == "fp32"
    assert m.source.sha256 == source_sha256(tiny_llama) and m.source.model_type == "llama"
    assert m.build.tool.startswith("onnxruntime-genai") and m.build.seconds > 0
    assert m.build.command.startswith("llmctl build-engine ") and "--target onnx" in \
        m.build.command
    assert m.built_on["arch"] and "onnxruntime" in m.built_on["packages"]
    assert m.serve_command == f"llmctl serve {onnx_fp32}"
    assert m.requirements.execution_provider == "CPUExecutionProvider"
    assert "model.onnx" in m.files and "config.json" in m.files


@pytest.mark.parametrize("requirements,host,message", [
    ({"arch": "aarch64"}, {}, "built for aarch64 and this machine is x86_64"),
    ({"arch": "x86_64", "cpu_flags": ["avx2", "avx512f", "amx_tile"]}, {},
     "CPU instructions this CPU lacks: amx_tile, avx512f"),
    ({"packages": {"torch": PackageRule(version="2.12.0+cpu", match="exact")}}, {},
     "compiled against torch 2.12.0+cpu and this machine has 2.13.0+cpu"),
    ({"packages": {"onnxruntime": PackageRule(version="1.40.0")}}, {},
     "needs onnxruntime >= 1.40.0; this machine has 1.31.1"),
    ({"gpu": True}, {}, "runs only on an NVIDIA GPU"),
    ({"packages": {"tensorrt-llm": PackageRule(version="1.2.1", match="exact")}}, {},
     "needs the Python package tensorrt-llm (1.2.1), which is not installed"),
])
def test_compatibility_problems_say_why(onnx_fp32, requirements, host, message):
    problems = compatibility_problems(_manifest(onnx_fp32, **requirements), _host(**host),
                                      providers=["CPUExecutionProvider"])
    assert any(message in p for p in problems), problems


def test_cuda_graph_on_a_cpu_only_onnxruntime(onnx_fp32):
    manifest = _manifest(onnx_fp32, execution_provider="CUDAExecutionProvider")
    problems = compatibility_problems(manifest, _host(), providers=["CPUExecutionProvider"])
    assert problems == ["it was built for onnxruntime's CUDAExecutionProvider, which this "
                        "onnxruntime does not offer (it has: CPUExecutionProvider)"]
    assert compatibility_problems(manifest, _host(), providers=[
        "CUDAExecutionProvider", "CPUExecutionProvider"]) == []


def test_matching_machine_has_no_problems(onnx_fp32):
    manifest = _manifest(onnx_fp32, arch="x86_64", cpu_flags=["avx2"],
                         packages={"torch": PackageRule(version="2.13.0+cpu", match="exact")})
    assert compatibility_problems(manifest, _host(), providers=["CPUExecutionProvider"]) == []


def test_edited_manifest_for_another_machine_fails_to_open(onnx_fp32, tmp_path):
    """Simulate an engine built elsewhere: an ISA flag no CPU has and an ARM build."""
    engine = tmp_path / "engine"
    shutil.copytree(onnx_fp32, engine)
    data = json.loads((engine / MANIFEST_NAME).read_text())
    data["requirements"]["cpu_flags"] = ["avx512_imaginary"]
    data["requirements"]["packages"]["onnxruntime"] = {"version": "99.0.0",
                                                       "match": "at_least"}
    (engine / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(EngineIncompatibleError) as err:
        open_engine(engine)
    text = str(err.value)
    assert "cannot load here" in text and "avx512_imaginary" in text
    assert "onnxruntime >= 99.0.0" in text and "rebuild it on this machine: llmctl " \
        "build-engine" in text
    assert open_engine(engine, check=False).provider == "CPUExecutionProvider"


def test_truncated_file_is_caught(onnx_fp32, tmp_path):
    engine = tmp_path / "engine"
    shutil.copytree(onnx_fp32, engine)
    data = engine / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(LlmctlError, match="damaged: model.onnx.data has"):
        open_engine(engine)


def test_not_an_engine_and_hand_edited_manifests(tmp_path, onnx_fp32):
    with pytest.raises(NotAnEngineError, match="no llmctl-engine.json"):
        read_manifest(tmp_path)
    engine = tmp_path / "engine"
    shutil.copytree(onnx_fp32, engine)
    data = json.loads((engine / MANIFEST_NAME).read_text())
    data["requirments"] = {}
    (engine / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(NotAnEngineError, match="requirments"):
        read_manifest(engine)
    data.pop("requirments")
    data["format_version"] = 7
    (engine / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(EngineIncompatibleError, match="manifest format 7"):
        read_manifest(engine)
