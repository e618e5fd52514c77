"""``--target torch-compile``: an AOTInductor package of the decoder forward.

``torch.export`` traces :class:`~llmctl.engines.static_decoder.StaticDecoder` (every
family the serving engine runs, sliding windows included) with
dynamic batch (1..max_batch_size), chunk length and cache length, and
``torch._inductor.aoti_compile_and_package`` turns it into ``model.pt2``: generated C++
kernels compiled with gcc plus the weights. Loading it (:mod:`llmctl.engines.aoti_runtime`)
needs no tracing, no compiler and no Python model code.

What the package ties itself to (and the manifest requires):

- the exact torch build (the .so links against that libtorch);
- the CPU's instruction set: Inductor compiles with ``-march=native`` and vectorizes for
  the widest ISA it detects, unless told otherwise. ``--option isa=x86-64-v3`` (AVX2) or
  ``x86-64-v4`` (AVX-512) builds for a named level instead, so the package runs on every
  CPU of that level; ``native`` (default) requires every ISA extension of the build CPU.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from llmctl.engines.manifest import PackageRule, Requirements
from llmctl.engines.options import CommonOptions
from llmctl.engines.source import copy_metadata, float_checkpoint
from llmctl.engines.targets import BuildContext, Target, TargetResult
from llmctl.errors import UsageError
from llmctl.utils.dtypes import torch_dtype

PACKAGE = "model.pt2"
_V2 = ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3")
_V3 = _V2 + ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
# isa option -> (gcc -march value or None for native, Inductor cpp.simdlen, required flags)
ISA_LEVELS: dict[str, tuple[str | None, int | None, tuple[str, ...]]] = {
    "native": (None, None, ()),  # flags: every ISA extension of the build CPU
    "x86-64-v3": ("x86-64-v3", 256, _V3),
    "x86-64-v4": ("x86-64-v4", 512, _V4),
}
# /proc/cpuinfo flags that name instruction-set extensions a compiler may emit.
ISA_EXTENSIONS = frozenset(_V4 + (
    "sse", "sse2", "sse3", "aes", "pclmulqdq", "sha_ni", "gfni", "vaes", "vpclmulqdq", "adx",
    "avx_vnni", "avx512ifma", "avx512vbmi", "avx512_vbmi2", "avx512_vnni", "avx512_bitalg",
    "avx512_vpopcntdq", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
    "asimd", "sve", "sve2", "bf16", "i8mm"))


class TorchCompileOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    isa: Literal["native", "x86-64-v3", "x86-64-v4"] = "native"
    wrapper_opt: Literal["O0", "O1", "O2", "O3"] = Field(
        "O1", description="gcc level for the generated wrapper (O0 compiles much faster)")
    threads: int | None = Field(None, ge=1, description="torch threads while tracing")


def required_flags(isa: str, build_flags: frozenset[str]) -> list[str]:
    march, _, flags = ISA_LEVELS[isa]
    if march is None:
        return sorted(build_flags & ISA_EXTENSIONS)
    return sorted(flags)


class TorchCompileTarget(Target):
    name = "torch-compile"
    precisions = ("fp32", "bf16", "fp16")
    Options = TorchCompileOptions

    def check_request(self, common: CommonOptions, options: TorchCompileOptions) -> None:
        super().check_request(common, options)
        if common.device != "cpu":
            raise UsageError("the torch-compile target builds CPU packages here",
                             "use --device cpu (CUDA AOTInductor builds need a GPU and a "
                             "CUDA torch build)")
        import platform

        if options.isa != "native" and platform.machine() not in ("x86_64", "AMD64"):
            raise UsageError(f"isa={options.isa} is an x86-64 level", "use isa=native")

    def build(self, ctx: BuildContext) -> TargetResult:
        import platform

        import torch
        from torch.export import Dim, export

        from llmctl.engines.host import cpu_flags
        from llmctl.engines.static_decoder import build_static_decoder

        opts: TorchCompileOptions = ctx.options
        if opts.threads:
            torch.set_num_threads(opts.threads)
        dtype = torch_dtype(ctx.common.precision)
        model_dir = float_checkpoint(ctx.source, ctx.workdir)
        from llmctl.models.spec import ModelArch

        # the family's default where config.json leaves the context out (Gemma 2: 8192)
        config_max = ModelArch.from_config(ctx.source.config).max_position_embeddings or 2048
        max_len = min(ctx.common.max_seq_len or min(config_max, 2048), config_max)
        max_batch = ctx.common.max_batch_size
        ctx.log(f"tracing the decoder ({ctx.common.precision}, batch 1..{max_batch}, "
                f"context {max_len})")
        decoder, spec = build_static_decoder(model_dir, dtype, max_len)
        layers, heads, d = spec.num_layers, spec.num_kv_heads, spec.head_dim
        batch = Dim("batch", min=1, max=max(max_batch, 2))
        tokens = Dim("tokens", min=1, max=max_len)
        cache = Dim("cache", min=1, max=max_len + 64)
        example = (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                   torch.zeros(layers, 2, heads, 5, d, dtype=dtype),
                   torch.zeros(layers, 2, heads, 5, d, dtype=dtype))
        shapes = ({0: batch, 1: tokens}, {0: batch}, {1: batch, 3: cache}, {1: batch, 3: cache})
        start = time.perf_counter()
        with torch.no_grad():
            program = export(decoder, example, dynamic_shapes=shapes)
        traced = time.perf_counter() - start
        march, simdlen, _ = ISA_LEVELS[opts.isa]
        configs = {"aot_inductor.compile_wrapper_opt_level": opts.wrapper_opt}
        if march is not None:
            configs["cpp.march"] = march
            configs["cpp.simdlen"] = simdlen
        ctx.log("compiling with AOTInductor (gcc)")
        start = time.perf_counter()
        torch._inductor.aoti_compile_and_package(
            program, package_path=str(ctx.out / PACKAGE), inductor_configs=configs)
        compiled = time.perf_counter() - start
        copy_metadata(ctx.source.path, ctx.out, drop_quantization=True)
        from torch._inductor import cpu_vec_isa

        vec = cpu_vec_isa.pick_vec_isa()
        notes = []
        if ctx.source.quantization:
            notes.append("the source checkpoint was dequantized: the package computes "
                         f"with {ctx.common.precision} weights")
        return TargetResult(
            requirements=Requirements(
                arch=platform.machine(),
                cpu_flags=required_flags(opts.isa, cpu_flags()),
                packages={"torch": PackageRule(version=torch.__version__, match="exact")}),
            tool=f"torch {torch.__version__} export + AOTInductor",
            target_info={
                "package": PACKAGE, "dtype": ctx.common.precision,
                "num_layers": layers, "num_kv_heads": heads, "head_dim": d,
                "vocab_size": spec.vocab_size, "max_seq_len": max_len,
                "max_batch_size": max_batch, "isa": opts.isa,
                "inductor_vec_isa": str(vec) if opts.isa == "native" else f"simdlen {simdlen}",
                "inductor_configs": configs,
                "export_seconds": round(traced, 2), "compile_seconds": round(compiled, 2)},
            notes=notes)

    def open(self, path: Path, manifest, *, threads: int | None = None,
             max_batch_size: int | None = None, **_):
        from llmctl.engines.aoti_runtime import AotiRuntime

        return AotiRuntime(path, manifest.target_info, threads=threads,
                           max_batch_size=max_batch_size)
