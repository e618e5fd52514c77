"""``--target tensorrt-llm``: everything an NVIDIA box needs to serve with TensorRT-LLM.

Current TensorRT-LLM releases run Hugging Face checkpoints through their PyTorch
backend, configured by LLM-API options in a YAML file, instead of prebuilt TensorRT
engines. So the "engine" here is::

    checkpoint/                  the HF checkpoint (safetensors, config, tokenizer)
    extra_llm_api_options.yaml   KV cache fraction + block reuse, batch / token limits,
                                 CUDA graphs, speculative decoding; validated against
                                 the pinned release's option names
    bench_dataset.jsonl          a synthetic trtllm-bench dataset (token ids)
    commands.sh                  the exact trtllm-serve / trtllm-bench commands

TensorRT-LLM cannot be installed on these machines (its PyPI wheels download the real
one from NVIDIA's index). When ``tensorrt_llm`` is importable and a GPU is present, the
build also validates the YAML with the installed release's ``TorchLlmArgs`` and loads the
model once for a short generation; that path has not run here.

Quantized checkpoints: TensorRT-LLM's PyTorch backend loads ModelOpt checkpoints
(``hf_quant_config.json``: FP8, NVFP4, W4A16 AWQ ...). llmctl does not write that
format; a compressed-tensors checkpoint is copied as is and flagged in the manifest.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from llmctl.engines.manifest import PackageRule, Requirements
from llmctl.engines.options import CommonOptions
from llmctl.engines.source import METADATA_FILES
from llmctl.engines.targets import BuildContext, Target, TargetResult
from llmctl.errors import ConfigError, MissingDependencyError, UsageError
from llmctl.serve.handoff.trtllm_options import (
    PINNED_VERSION,
    validate_options,
    validate_with_library,
)
from llmctl.utils.dtypes import dtype_name

YAML_NAME = "extra_llm_api_options.yaml"
CHECKPOINT = "checkpoint"
DATASET = "bench_dataset.jsonl"


class TensorRTLLMOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: str = PINNED_VERSION
    free_gpu_memory_fraction: float = Field(0.9, gt=0.0, le=1.0)
    enable_block_reuse: bool = True
    max_num_tokens: int = Field(8192, ge=1)
    tp_size: int = Field(1, ge=1)
    cuda_graphs: bool = True
    speculative: Literal["none", "ngram", "draft", "eagle3"] = "none"
    max_draft_len: int = Field(4, ge=1, le=16)
    draft_model: str | None = None  # for draft / eagle3: a path on the GPU machine
    extra_yaml: str | None = None  # a user YAML merged over the generated options
    port: int = 8000
    dataset_requests: int = Field(64, ge=1)
    dataset_input_len: int = Field(128, ge=1)
    dataset_output_len: int = Field(128, ge=1)


def llm_api_options(common: CommonOptions, opts: TensorRTLLMOptions, precision: str) -> dict:
    data: dict = {
        "dtype": dtype_name(precision),  # TorchLlmArgs.dtype: torch's name, or auto
        "max_batch_size": common.max_batch_size,
        "max_num_tokens": opts.max_num_tokens,
        "kv_cache_config": {"free_gpu_memory_fraction": opts.free_gpu_memory_fraction,
                            "enable_block_reuse": opts.enable_block_reuse},
    }
    if common.max_seq_len:
        data["max_seq_len"] = common.max_seq_len
    if opts.tp_size > 1:
        data["tensor_parallel_size"] = opts.tp_size
    if opts.cuda_graphs:
        data["cuda_graph_config"] = {"enable_padding": True,
                                     "max_batch_size": common.max_batch_size}
    spec = speculative_config(opts)
    if spec:
        data["speculative_config"] = spec
    if opts.extra_yaml:
        import yaml

        extra = yaml.safe_load(Path(opts.extra_yaml).read_text()) or {}
        if not isinstance(extra, dict):
            raise ConfigError(f"{opts.extra_yaml} is not a YAML mapping",
                              "write option: value pairs")
        data = _merge(data, extra)
    return data


def speculative_config(opts: TensorRTLLMOptions) -> dict | None:
    if opts.speculative == "none":
        return None
    if opts.speculative == "ngram":
        return {"decoding_type": "NGram", "max_draft_len": opts.max_draft_len,
                "max_matching_ngram_size": 2, "is_keep_all": True, "is_use_oldest": True,
                "is_public_pool": True}
    if not opts.draft_model:
        raise UsageError(f"speculative={opts.speculative} needs a draft model",
                         "add --option draft_model=PATH (a path on the GPU machine)")
    if opts.speculative == "draft":
        return {"decoding_type": "DraftTarget", "max_draft_len": opts.max_draft_len,
                "speculative_model_dir": opts.draft_model}
    return {"decoding_type": "Eagle", "max_draft_len": opts.max_draft_len,
            "speculative_model_dir": opts.draft_model, "eagle3_one_model": True}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def commands(model_name: str, opts: TensorRTLLMOptions) -> dict[str, str]:
    """Commands to run from inside the engine directory."""
    backend = ["--backend", "pytorch"]
    serve = ["trtllm-serve", f"./{CHECKPOINT}", *backend, "--host", "0.0.0.0", "--port",
             str(opts.port), "--extra_llm_api_options", YAML_NAME]
    common = ["trtllm-bench", "--model", model_name, "--model_path", f"./{CHECKPOINT}"]
    throughput = [*common, "throughput", "--dataset", DATASET, *backend,
                  "--extra_llm_api_options", YAML_NAME]
    latency = [*common, "latency", "--dataset", DATASET, *backend,
               "--extra_llm_api_options", YAML_NAME]
    return {"serve": shlex.join(serve), "bench_throughput": shlex.join(throughput),
            "bench_latency": shlex.join(latency),
            "install": f"pip install tensorrt-llm=={opts.version}"}


def write_dataset(path: Path, vocab_size: int, opts: TensorRTLLMOptions, seed: int = 0) -> None:
    """trtllm-bench's JSONL: ``{"task_id", "input_ids", "output_tokens"}`` per request."""
    import random

    rng = random.Random(seed)
    with open(path, "w") as handle:
        for i in range(opts.dataset_requests):
            ids = [rng.randrange(100, vocab_size) for _ in range(opts.dataset_input_len)]
            handle.write(json.dumps({"task_id": i, "input_ids": ids,
                                     "output_tokens": opts.dataset_output_len}) + "\n")


def copy_checkpoint(src: Path, dest: Path) -> None:
    """Weights are hard-linked when src and dest share a filesystem (no extra space)."""
    dest.mkdir(parents=True)
    for path in sorted(src.iterdir()):
        if path.is_file() and (path.suffix in (".safetensors", ".json")
                               or path.name in METADATA_FILES):
            try:
                os.link(path, dest / path.name)
            except OSError:
                shutil.copy2(path, dest / path.name)


def library_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorrt_llm") is not None


class TensorRTLLMTarget(Target):
    name = "tensorrt-llm"
    precisions = ("auto", "bf16", "fp16", "fp32")
    Options = TensorRTLLMOptions
    runnable = False

    def check_request(self, common: CommonOptions, options: TensorRTLLMOptions) -> None:
        if common.precision in ("int4", "int8", "fp8", "nvfp4"):
            raise UsageError(
                f"llmctl cannot write TensorRT-LLM's quantized format ({common.precision})",
                "quantize with NVIDIA ModelOpt (hf_quant_config.json checkpoints), or build "
                "--precision auto|bf16|fp16 here")
        super().check_request(common, options)

    def build(self, ctx: BuildContext) -> TargetResult:
        import yaml

        opts: TensorRTLLMOptions = ctx.options
        data = llm_api_options(ctx.common, opts, ctx.common.precision)
        problems = validate_options(data)
        if problems:
            raise ConfigError("the TensorRT-LLM options do not validate against release "
                              f"{opts.version}: " + "; ".join(problems),
                              "fix the keys in --option extra_yaml=FILE")
        ctx.log("copying the checkpoint")
        copy_checkpoint(ctx.source.path, ctx.out / CHECKPOINT)
        header = (f"# TensorRT-LLM {opts.version} LLM-API options (PyTorch backend), "
                  f"written by llmctl build-engine.\n# Pass to: trtllm-serve / trtllm-bench "
                  f"--extra_llm_api_options {YAML_NAME}\n")
        (ctx.out / YAML_NAME).write_text(header + yaml.safe_dump(data, sort_keys=False))
        write_dataset(ctx.out / DATASET, int(ctx.source.config.get("vocab_size", 32000)), opts)
        name = ctx.source.config.get("_name_or_path") or ctx.source.path.name
        cmds = commands(str(name), opts)
        script = ["#!/bin/sh", "# Run on a machine with an NVIDIA GPU.", "set -e",
                  'cd "$(dirname "$0")"', f"# {cmds['install']}",
                  f"# serve (OpenAI-compatible on :{opts.port}):", cmds["serve"],
                  "# offline benchmarks:", f"# {cmds['bench_throughput']}",
                  f"# {cmds['bench_latency']}"]
        (ctx.out / "commands.sh").write_text("\n".join(script) + "\n")
        (ctx.out / "commands.sh").chmod(0o755)
        notes = [f"validated offline against llmctl's table of TensorRT-LLM {opts.version} "
                 "option names; not run on a GPU by llmctl"]
        if ctx.source.quantization:
            notes.append("the checkpoint is compressed-tensors; TensorRT-LLM's PyTorch backend "
                          "is documented to load ModelOpt quantized checkpoints: check that "
                          "this release reads this one")
        validated = self._validate_installed(ctx, data)
        if validated:
            notes.append(validated)
        return TargetResult(
            requirements=Requirements(
                gpu=True,
                packages={"tensorrt-llm": PackageRule(version=opts.version, match="exact")}),
            tool=f"llmctl (TensorRT-LLM {opts.version} option table)",
            target_info={"tensorrt_llm_version": opts.version, "yaml": YAML_NAME,
                         "checkpoint": CHECKPOINT, "dataset": DATASET,
                         "llm_api_options": data, "commands": cmds},
            notes=notes,
            serve_command=f"cd {shlex.quote(str(self._final_path(ctx)))} && {cmds['serve']}")

    @staticmethod
    def _final_path(ctx: BuildContext) -> Path:
        # ctx.out is the temporary directory that becomes the engine dir: name the final one
        name = ctx.out.name.split(".tmp-")[0].lstrip(".")
        return ctx.out.parent / name

    def _validate_installed(self, ctx: BuildContext, data: dict) -> str | None:
        """With the library and a GPU: validate with TorchLlmArgs and load the model once."""
        if not library_available():
            return None
        from llmctl.engines.host import nvidia_gpus

        problems = validate_with_library(data, str(ctx.out / CHECKPOINT))
        if problems:
            raise ConfigError("the installed TensorRT-LLM rejects the options: "
                              + "; ".join(problems), "adjust the options for this release")
        if not nvidia_gpus():
            return "validated with the installed tensorrt_llm (no GPU: model not loaded)"
        from tensorrt_llm import LLM, SamplingParams  # type: ignore[import-not-found]

        llm = LLM(model=str(ctx.out / CHECKPOINT), **data)
        out = llm.generate(["Hello"], SamplingParams(max_tokens=8))
        llm.shutdown()
        return f"loaded and generated with the installed tensorrt_llm: {out[0].outputs[0].text!r}"

    def open(self, path: Path, manifest, **_):
        if not library_available():
            raise MissingDependencyError(
                "TensorRT-LLM engines run only with the tensorrt_llm package on an NVIDIA GPU",
                f"on a GPU machine: pip install tensorrt-llm=={manifest.target_info.get('tensorrt_llm_version', PINNED_VERSION)}"
                f" and run: {manifest.serve_command}")
        raise UsageError("llmctl does not drive TensorRT-LLM in-process",
                         f"serve it with: {manifest.serve_command}")
