import json

import pytest
import yaml

from llmctl.engines.builder import build_engine
from llmctl.engines.engine_dir import open_engine
from llmctl.engines.manifest import EngineIncompatibleError, read_manifest
from llmctl.engines.options import CommonOptions
from llmctl.errors import ConfigError, MissingDependencyError, UsageError
from llmctl.serve.handoff.trtllm_options import PINNED_VERSION, validate_options


@pytest.fixture(scope="module")
def trt_engine(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("trt") / "engine"
    build_engine(str(tiny_llama), "tensorrt-llm", out,
                 common=CommonOptions(max_batch_size=32, max_seq_len=1024),
                 options={"speculative": "ngram", "free_gpu_memory_fraction": "0.85"})
    return out


def test_yaml_validates_against_the_pinned_release(trt_engine):
    data = yaml.safe_load((trt_engine / "extra_llm_api_options.yaml").read_text())
    assert validate_options(data) == []
    assert data["kv_cache_config"] == {"free_gpu_memory_fraction": 0.85,
                                       "enable_block_reuse": True}
    assert data["max_batch_size"] == 32 and data["max_seq_len"] == 1024
    assert data["max_num_tokens"] == 8192 and data["dtype"] == "auto"
    assert data["speculative_config"]["decoding_type"] == "NGram"
    assert data["cuda_graph_config"] == {"enable_padding": True, "max_batch_size": 32}


def test_engine_dir_has_checkpoint_commands_and_pinned_manifest(trt_engine):
    m = read_manifest(trt_engine)
    assert m.requirements.gpu is True
    assert m.requirements.packages["tensorrt-llm"].version == PINNED_VERSION
    assert m.target_info["tensorrt_llm_version"] == PINNED_VERSION
    assert (trt_engine / "checkpoint" / "model.safetensors").is_file()
    assert (trt_engine / "checkpoint" / "tokenizer.json").is_file()
    serve = m.target_info["commands"]["serve"]
    assert serve.startswith("trtllm-serve ./checkpoint --backend pytorch")
    assert "--extra_llm_api_options extra_llm_api_options.yaml" in serve
    assert serve in m.serve_command and m.serve_command.startswith(f"cd {trt_engine} && ")
    bench = m.target_info["commands"]["bench_throughput"]
    assert "throughput --dataset bench_dataset.jsonl" in bench
    script = (trt_engine / "commands.sh").read_text()
    assert serve in script and f"pip install tensorrt-llm=={PINNED_VERSION}" in script
    rows = [json.loads(line) for line in (trt_engine / "bench_dataset.jsonl").open()]
    assert len(rows) == 64 and len(rows[0]["input_ids"]) == 128
    assert rows[0]["output_tokens"] == 128 and max(max(r["input_ids"]) for r in rows) < 512


def test_without_the_library_the_error_is_clear(trt_engine):
    import importlib.util

    if importlib.util.find_spec("tensorrt_llm") is not None:
        pytest.skip("tensorrt_llm is installed")
    with pytest.raises(EngineIncompatibleError) as err:
        open_engine(trt_engine)
    assert "NVIDIA GPU" in str(err.value) and "tensorrt-llm" in str(err.value)
    with pytest.raises(MissingDependencyError) as err:
        open_engine(trt_engine, check=False)
    assert "pip install tensorrt-llm==" in str(err.value)
    assert "trtllm-serve" in str(err.value)


@pytest.mark.parametrize("data,message", [
    ({"kv_cache_config": {"free_gpu_mem_fraction": 0.9}},
     "kv_cache_config.free_gpu_mem_fraction: not an option of TensorRT-LLM "
     f"{PINNED_VERSION} (did you mean 'free_gpu_memory_fraction'?)"),
    ({"max_batch_sizes": 8}, "did you mean 'max_batch_size'?"),
    ({"max_batch_size": "8"}, "max_batch_size: expected int"),
    ({"kv_cache_config": {"enable_block_reuse": "yes"}}, "expected bool"),
    ({"kv_cache_config": {"free_gpu_memory_fraction": 1.5}}, "must be in (0, 1]"),
    ({"speculative_config": {"decoding_type": "Medusa2", "max_draft_len": 2}},
     "'Medusa2' is not one of"),
    ({"speculative_config": {"decoding_type": "NGram"}}, "max_draft_len: required"),
    ({"cuda_graph_config": {"batch_sizes": [1, "2"]}}, "expected a list of integers"),
])
def test_option_table_catches_mistakes(data, message):
    problems = validate_options(data)
    assert any(message in p for p in problems), problems


def test_bad_requests_fail_before_any_work(tiny_llama, tmp_path):
    with pytest.raises(UsageError, match="ModelOpt"):
        build_engine(str(tiny_llama), "tensorrt-llm", tmp_path / "a",
                     common=CommonOptions(precision="int4"))
    with pytest.raises(UsageError, match="draft_model"):
        build_engine(str(tiny_llama), "tensorrt-llm", tmp_path / "b",
                     options={"speculative": "draft"})
    with pytest.raises(ConfigError, match="free_gpu_memory_fractoin"):
        build_engine(str(tiny_llama), "tensorrt-llm", tmp_path / "c",
                     options={"free_gpu_memory_fractoin": "0.5"})
    extra = tmp_path / "extra.yaml"
    extra.write_text("kv_cache_config:\n  enable_blockreuse: false\n")
    with pytest.raises(ConfigError, match="enable_blockreuse"):
        build_engine(str(tiny_llama), "tensorrt-llm", tmp_path / "d",
                     options={"extra_yaml": str(extra)})
    assert not any((tmp_path / n).exists() for n in "abcd")


def test_user_yaml_is_merged(tiny_llama, tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text("kv_cache_config:\n  enable_block_reuse: false\nprint_iter_log: true\n")
    out = tmp_path / "e"
    build_engine(str(tiny_llama), "tensorrt-llm", out, options={"extra_yaml": str(extra),
                                                               "speculative": "draft",
                                                               "draft_model": "/m/draft"})
    data = yaml.safe_load((out / "extra_llm_api_options.yaml").read_text())
    assert data["kv_cache_config"] == {"free_gpu_memory_fraction": 0.9,
                                       "enable_block_reuse": False}
    assert data["print_iter_log"] is True
    assert data["speculative_config"] == {"decoding_type": "DraftTarget", "max_draft_len": 4,
                                          "speculative_model_dir": "/m/draft"}
