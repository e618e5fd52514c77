"""``--target onnx``: a decoder with KV-cache inputs/outputs for ONNX Runtime.

The graph is made by onnxruntime-genai's model builder (the tool ONNX Runtime ships
for exactly this job: fused QKV, ``GroupQueryAttention`` with in-op RoPE,
``SkipSimplifiedLayerNormalization``, and int4 weights as ``MatMulNBits``), run as a
subprocess so its logging and memory stay out of ours. It reads a local HF directory
offline and works with transformers 5; optimum-onnx does not (it pins
transformers<4.58, see shared/FACTS.md).

Families: the builder's graphs of llama, qwen2, qwen3, gemma and granite compute what
transformers computes (float32 logits within 1e-4; tests/engines/test_families.py checks
llama, qwen3, gemma and granite); :data:`REFUSED_FAMILIES` and any config with
sliding-window attention (mistral's included) are refused before the build, naming why.

Precisions (``-p`` of the builder x ``-e`` execution provider):

- ``fp32``: CPU or CUDA.
- ``fp16``: CUDA only (the builder's CPU fp16 graph is not a supported combination).
- ``int4``: weights in ``MatMulNBits`` blocks of ``block_size`` along the input
  dimension, one fp32 scale per block (symmetric: zero point 8 implied). SmolLM2's
  576-wide rows split into 18 blocks of 32 or 9 of 64; 128 does not divide 576 and the
  builder then pads the last block. ``accuracy_level`` 4 lets the CPU kernel quantize
  activations to int8 per block for an int8 dot product (fastest on CPU; adds activation
  error), 0/1 keeps fp32 activations.
- ``int8``: the same with 8-bit weights.

A compressed-tensors checkpoint is dequantized first (:func:`float_checkpoint`), so the
int4 graph re-quantizes the dequantized weights with round-to-nearest: the result is
close to, not bit-identical with, llmctl's GPTQ/AWQ weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmctl.engines.manifest import PackageRule, Requirements
from llmctl.engines.options import CommonOptions
from llmctl.engines.source import copy_metadata, float_checkpoint
from llmctl.engines.targets import BuildContext, Target, TargetResult
from llmctl.errors import LlmctlError, MissingDependencyError, UsageError

# llmctl precision -> builder precision, and the execution providers it builds for.
PRECISIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "fp32": ("fp32", ("cpu", "cuda")),
    "fp16": ("fp16", ("cuda",)),
    "int4": ("int4", ("cpu", "cuda")),
    "int8": ("int8", ("cpu", "cuda")),
}
EXECUTION_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
# model type -> why the builder's graph cannot run it here; every other family llmctl runs is
# built (tests/engines/test_families.py checks the logits against transformers')
_WINDOWS = ("ONNX Runtime's GroupQueryAttention with a sliding window needs a cache as long "
            "as the window from the first token, and llmctl's ONNX runtime grows its cache "
            "from empty")
REFUSED_FAMILIES: dict[str, str] = {
    "gemma2": _WINDOWS,
    "gemma3_text": "the builder cannot read Gemma 3's per-layer-type rope_parameters",
    "phi3": "the builder cannot read Phi-3's LongRoPE rope_parameters",
    "olmo2": "the builder has no OLMo 2 graph",
}
BUILDER_MODULE = "onnxruntime_genai.models.builder"
PYTHON_ENV = "LLMCTL_ORTGENAI_PYTHON"  # a python with onnxruntime-genai, if not this one


class OnnxOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    block_size: int = Field(32, description="int4/int8 block size along the input dim")
    accuracy_level: Literal[0, 1, 2, 3, 4] | None = Field(
        None, description="MatMulNBits compute type: 4 int8 (CPU default), 0/1 fp32")
    symmetric: bool = True
    threads: int | None = Field(None, ge=1, description="builder threads (OMP_NUM_THREADS)")

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value not in (16, 32, 64, 128, 256):
            raise ValueError("block_size must be 16, 32, 64, 128 or 256")
        return value


def builder_python() -> str:
    """The interpreter that runs the model builder (this one, or $LLMCTL_ORTGENAI_PYTHON)."""
    override = os.environ.get(PYTHON_ENV)
    if override:
        return override
    import importlib.util

    if importlib.util.find_spec("onnxruntime_genai") is None or \
            importlib.util.find_spec("onnx_ir") is None:
        raise MissingDependencyError(
            "building ONNX engines needs onnxruntime-genai's model builder",
            "pip install 'llmctl[onnx]' (onnxruntime-genai onnx-ir), or point "
            f"{PYTHON_ENV} at a python that has them")
    return sys.executable


def builder_command(python: str, model_dir: Path, out: Path, cache: Path, precision: str,
                    ep: str, options: OnnxOptions) -> list[str]:
    extra = []
    if precision in ("int4", "int8"):
        extra += [f"block_size={options.block_size}",
                  f"is_symmetric={'true' if options.symmetric else 'false'}"]
        if options.accuracy_level is not None:
            extra.append(f"accuracy_level={options.accuracy_level}")
    cmd = [python, "-m", BUILDER_MODULE, "-m", str(model_dir), "-i", str(model_dir),
           "-o", str(out), "-p", precision, "-e", ep, "-c", str(cache)]
    return cmd + (["--extra_options", *extra] if extra else [])


def graph_summary(path: Path) -> dict:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    ops = Counter(node.op_type for node in model.graph.node)
    opsets = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    block = None
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            block = {"bits": attrs.get("bits"), "block_size": attrs.get("block_size"),
                     "accuracy_level": attrs.get("accuracy_level", 0)}
            break
    return {"ops": dict(sorted(ops.items())), "opsets": opsets, "matmul_nbits": block}


class OnnxTarget(Target):
    name = "onnx"
    precisions = tuple(PRECISIONS)
    Options = OnnxOptions

    def check_request(self, common: CommonOptions, options: OnnxOptions) -> None:
        super().check_request(common, options)
        eps = PRECISIONS[common.precision][1]
        if common.device not in eps:
            raise UsageError(f"ONNX {common.precision} is built for {', '.join(eps)}, not "
                             f"{common.device}",
                             "use --precision fp32 or int4 on CPU (fp16 needs --device cuda)")

    def check_source(self, source) -> None:
        super().check_source(source)
        from llmctl.models.spec import ModelArch

        why = REFUSED_FAMILIES.get(source.model_type)
        if why is None and any(ModelArch.from_config(source.config).layer_windows):
            why = f"its config sets sliding-window attention; {_WINDOWS}"
        if why is not None:
            raise UsageError(f"the onnx target does not build {source.model_type} models: "
                             f"{why}", "use --target torch-compile, or serve the checkpoint "
                             "itself (llmctl serve)")

    def build(self, ctx: BuildContext) -> TargetResult:
        from llmctl.engines.host import package_version

        opts: OnnxOptions = ctx.options
        precision, _ = PRECISIONS[ctx.common.precision]
        python = builder_python()
        model_dir = float_checkpoint(ctx.source, ctx.workdir)
        cmd = builder_command(python, model_dir, ctx.out, ctx.workdir / "hf-cache", precision,
                              ctx.common.device, opts)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        if opts.threads:
            env["OMP_NUM_THREADS"] = str(opts.threads)
        ctx.log(f"running the ONNX model builder ({precision}, {ctx.common.device})")
        log_path = ctx.workdir / "builder.log"
        with open(log_path, "w") as log_file:
            proc = subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                  check=False)
        if proc.returncode != 0 or not (ctx.out / "model.onnx").is_file():
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-8:])
            raise LlmctlError(f"the ONNX model builder failed (exit {proc.returncode}):\n{tail}",
                              "run with LLMCTL_DEBUG=1 for the command, or try another "
                              "precision; --target torch-compile builds every family")
        copy_metadata(ctx.source.path, ctx.out, drop_quantization=True)
        genai = json.loads((ctx.out / "genai_config.json").read_text())["model"]
        summary = graph_summary(ctx.out / "model.onnx")
        ort_version = package_version("onnxruntime") or package_version("onnxruntime-gpu")
        genai_version = package_version("onnxruntime-genai")
        major_minor = ".".join((ort_version or "1.0").split(".")[:2]) + ".0"
        notes = []
        if ctx.source.quantization:
            notes.append("the source checkpoint was dequantized and re-quantized by the "
                         "builder (round-to-nearest), not copied bit for bit")
        return TargetResult(
            requirements=Requirements(
                execution_provider=EXECUTION_PROVIDERS[ctx.common.device],
                packages={"onnxruntime": PackageRule(version=major_minor, match="at_least")}),
            tool=f"onnxruntime-genai {genai_version} model builder",
            target_info={
                "graph": "model.onnx", "builder_precision": precision,
                "execution_provider": ctx.common.device,
                "context_length": genai["context_length"],
                "num_layers": genai["decoder"]["num_hidden_layers"],
                "num_kv_heads": genai["decoder"]["num_key_value_heads"],
                "head_dim": genai["decoder"]["head_size"],
                "vocab_size": genai["vocab_size"],
                "built_with": {"onnxruntime": ort_version, "onnxruntime-genai": genai_version},
                **summary},
            notes=notes)

    def open(self, path: Path, manifest, *, device: str | None = None, threads: int | None = None,
             strict_provider: bool = False, max_batch_size: int | None = None,
             spin: bool | None = None, **_):
        from llmctl.engines.onnx_runtime import OrtRuntime

        device = device or manifest.target_info.get("execution_provider", "cpu")
        return OrtRuntime(path, device=device, threads=threads, strict_provider=strict_provider,
                          max_batch_size=max_batch_size, spin=spin)
