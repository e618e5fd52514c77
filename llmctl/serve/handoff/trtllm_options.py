"""TensorRT-LLM LLM-API option names, as data, for validating ``extra_llm_api_options``.

TensorRT-LLM's ``TorchLlmArgs`` (PyTorch backend) and its nested configs are pydantic
models with ``extra="forbid"``: a misspelt key in the YAML passed to ``trtllm-serve
--extra_llm_api_options`` fails at server start, on the GPU box. This table lets llmctl
fail at build time instead, without the library.

The names are those of the pinned release (:data:`PINNED_VERSION`), taken from
TensorRT-LLM's LLM API reference (``TorchLlmArgs``, ``KvCacheConfig``,
``CudaGraphConfig``, ``NGramDecodingConfig``, ``DraftTargetDecodingConfig``,
``EagleDecodingConfig``, ``SchedulerConfig``): the fields llmctl writes plus the
commonly tuned ones, not every field of the release. Where ``tensorrt_llm`` is
importable, :func:`validate_with_library` checks the YAML with the installed release's
own models, which is authoritative. Not verified on a machine with the library: this
table has only been checked against the documentation.
"""

from __future__ import annotations

from typing import Any

PINNED_VERSION = "1.2.1"

# type names: bool, int, float (int accepted), str, list[int], dict (free-form),
# or another table's name (a nested config).
KV_CACHE_CONFIG: dict[str, str] = {
    "enable_block_reuse": "bool",
    "max_tokens": "int",
    "max_attention_window": "list[int]",
    "sink_token_length": "int",
    "free_gpu_memory_fraction": "float",
    "host_cache_size": "int",
    "onboard_blocks": "bool",
    "cross_kv_cache_fraction": "float",
    "secondary_offload_min_priority": "int",
    "event_buffer_max_size": "int",
    "enable_partial_reuse": "bool",
    "copy_on_partial_reuse": "bool",
    "use_uvm": "bool",
    "dtype": "str",
}
CUDA_GRAPH_CONFIG: dict[str, str] = {
    "batch_sizes": "list[int]",
    "max_batch_size": "int",
    "enable_padding": "bool",
}
SCHEDULER_CONFIG: dict[str, str] = {
    "capacity_scheduler_policy": "str",
    "context_chunking_policy": "str",
}
_SPEC_COMMON = {"decoding_type": "str", "max_draft_len": "int"}
# decoding_type -> that config's fields
SPECULATIVE_CONFIGS: dict[str, dict[str, str]] = {
    "NGram": {**_SPEC_COMMON, "max_matching_ngram_size": "int", "is_keep_all": "bool",
              "is_use_oldest": "bool", "is_public_pool": "bool"},
    "DraftTarget": {**_SPEC_COMMON, "speculative_model_dir": "str"},
    "Eagle": {**_SPEC_COMMON, "speculative_model_dir": "str", "eagle3_one_model": "bool",
              "num_eagle_layers": "int", "max_non_leaves_per_layer": "int",
              "eagle_choices": "list"},
    "MTP": {**_SPEC_COMMON, "num_nextn_predict_layers": "int"},
}
TORCH_LLM_ARGS: dict[str, str] = {
    "model": "str",
    "tokenizer": "str",
    "backend": "str",
    "dtype": "str",
    "trust_remote_code": "bool",
    "tensor_parallel_size": "int",
    "pipeline_parallel_size": "int",
    "moe_expert_parallel_size": "int",
    "enable_attention_dp": "bool",
    "max_batch_size": "int",
    "max_num_tokens": "int",
    "max_seq_len": "int",
    "max_input_len": "int",
    "max_beam_width": "int",
    "enable_chunked_prefill": "bool",
    "kv_cache_config": "kv_cache_config",
    "cuda_graph_config": "cuda_graph_config",
    "scheduler_config": "scheduler_config",
    "speculative_config": "speculative_config",
    "disable_overlap_scheduler": "bool",
    "attn_backend": "str",
    "guided_decoding_backend": "str",
    "print_iter_log": "bool",
    "enable_iter_perf_stats": "bool",
    "stream_interval": "int",
    "num_postprocess_workers": "int",
    "moe_config": "dict",
}
TABLES: dict[str, dict[str, str]] = {
    "kv_cache_config": KV_CACHE_CONFIG,
    "cuda_graph_config": CUDA_GRAPH_CONFIG,
    "scheduler_config": SCHEDULER_CONFIG,
}
# What the command line of trtllm-serve also accepts (reported, not an error).
_PY_TYPES = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,),
             "list": (list,), "dict": (dict,)}


def _type_problem(path: str, kind: str, value: Any) -> str | None:
    if kind == "list[int]":
        ok = isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value)
        return None if ok else f"{path}: expected a list of integers, got {value!r}"
    expected = _PY_TYPES[kind]
    if isinstance(value, bool) and kind in ("int", "float"):
        return f"{path}: expected {kind}, got a boolean"
    if not isinstance(value, expected):
        return f"{path}: expected {kind}, got {type(value).__name__} {value!r}"
    return None


def _unknown(path: str, key: str, table: dict[str, str]) -> str:
    import difflib

    close = difflib.get_close_matches(key, list(table), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{path}{key}: not an option of TensorRT-LLM {PINNED_VERSION}{hint}"


def validate_options(data: dict) -> list[str]:
    """Every problem with an ``extra_llm_api_options`` mapping (empty: valid)."""
    if not isinstance(data, dict):
        return ["the options must be a mapping of option names to values"]
    problems: list[str] = []
    for key, value in data.items():
        kind = TORCH_LLM_ARGS.get(key)
        if kind is None:
            problems.append(_unknown("", key, TORCH_LLM_ARGS))
        elif kind == "speculative_config":
            problems += _validate_speculative(value)
        elif kind in TABLES:
            if not isinstance(value, dict):
                problems.append(f"{key}: expected a mapping, got {value!r}")
                continue
            for sub, sub_value in value.items():
                sub_kind = TABLES[kind].get(sub)
                if sub_kind is None:
                    problems.append(_unknown(f"{key}.", sub, TABLES[kind]))
                else:
                    problem = _type_problem(f"{key}.{sub}", sub_kind, sub_value)
                    if problem:
                        problems.append(problem)
        else:
            problem = _type_problem(key, kind, value)
            if problem:
                problems.append(problem)
    kv = data.get("kv_cache_config") or {}
    fraction = kv.get("free_gpu_memory_fraction") if isinstance(kv, dict) else None
    if isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and \
            not 0.0 < fraction <= 1.0:
        problems.append("kv_cache_config.free_gpu_memory_fraction: must be in (0, 1]")
    return problems


def _validate_speculative(value: Any) -> list[str]:
    if not isinstance(value, dict):
        return [f"speculative_config: expected a mapping, got {value!r}"]
    kind = value.get("decoding_type")
    table = SPECULATIVE_CONFIGS.get(kind)
    if table is None:
        return [f"speculative_config.decoding_type: {kind!r} is not one of "
                f"{', '.join(SPECULATIVE_CONFIGS)}"]
    problems = []
    for key, sub in value.items():
        if key not in table:
            problems.append(_unknown("speculative_config.", key, table))
        else:
            problem = _type_problem(f"speculative_config.{key}", table[key], sub)
            if problem:
                problems.append(problem)
    if "max_draft_len" not in value:
        problems.append("speculative_config.max_draft_len: required")
    return problems


def validate_with_library(data: dict, model_dir: str) -> list[str]:
    """Validate with the installed TensorRT-LLM's own ``TorchLlmArgs`` (raises ImportError
    without the library). Not exercised on these machines: it cannot be installed here."""
    from pydantic import ValidationError
    from tensorrt_llm.llmapi import TorchLlmArgs  # type: ignore[import-not-found]

    try:
        TorchLlmArgs(model=model_dir, **data)
    except ValidationError as exc:
        return [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    except (TypeError, ValueError) as exc:
        return [str(exc)]
    return []
