"""Typed configuration: unknown keys and bad values fail loudly; KV cache sizing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmctl.errors import ConfigError, ResourceError, UsageError
from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.config import make_engine_config, parse_memory
from llmctl.serve.model.kv_cache import plan_kv_cache


def test_unknown_engine_key_names_it_and_the_allowed_ones():
    with pytest.raises(ConfigError, match="kv_cache_mem") as err:
        make_engine_config("m", kv_cache_mem="1GiB")
    assert "kv_cache_memory" in err.value.remedy


def test_bad_values_and_aliases():
    with pytest.raises(ConfigError, match="block_size"):
        make_engine_config("m", block_size=0)
    with pytest.raises(ConfigError, match="memory size"):
        make_engine_config("m", kv_cache_memory="lots")
    with pytest.raises(ConfigError, match="draft_model"):
        make_engine_config("m", speculative={"method": "draft"})
    with pytest.raises(ConfigError, match="num_speculative"):
        make_engine_config("m", speculative={"num_speculative": 3})
    assert make_engine_config("m", dtype="bf16").dtype == "bfloat16"


@pytest.mark.parametrize("text,expected", [("512MiB", ("bytes", 512 * 2**20)),
                                           ("2GB", ("bytes", 2e9)), ("0.3", ("fraction", 0.3)),
                                           (0.5, ("fraction", 0.5)), ("1 gib", ("bytes", 2**30))])
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


def test_kv_plan_from_bytes_fraction_and_cap():
    common = dict(num_layers=30, num_kv_heads=3, head_dim=64, itemsize=4, block_size=16,
                  max_num_seqs=1000, max_model_len=2048)
    plan = plan_kv_cache(budget="512MiB", **common)
    assert plan.bytes_per_block == 30 * 2 * 16 * 3 * 64 * 4
    assert plan.num_blocks == 512 * 2**20 // plan.bytes_per_block
    assert plan.num_tokens == plan.num_blocks * 16 and "tokens" in plan.describe()
    half = plan_kv_cache(budget=0.5, available=2**30, **common)
    assert half.num_blocks == 2**29 // plan.bytes_per_block
    capped = plan_kv_cache(budget="8GiB", **{**common, "max_num_seqs": 2})
    assert capped.num_blocks == 2 * 2048 // 16
    with pytest.raises(ResourceError, match="max_model_len"):
        plan_kv_cache(budget="1MiB", **common)


def test_sampling_params_validation():
    with pytest.raises(UsageError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(UsageError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(UsageError, match="allowed fields"):
        SamplingParams(max_new_tokens=3)
    with pytest.raises(UsageError, match="stop"):
        SamplingParams(stop=[""])
    assert SamplingParams(stop="x").stop == ("x",)


def test_lazy_exports_keep_plain_import_torch_free():
    code = ("import sys, llmctl, llmctl.serve; print('torch' in sys.modules); "
            "from llmctl import LLM, SamplingParams; print(LLM.__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "LLM", "True"]
