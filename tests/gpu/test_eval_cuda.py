"""``llmctl eval --backend serve`` on CUDA: the candidate and its reference run in the
serving engine on the GPU; PPL and KLD equal the same evaluation on the CPU within
float32 summation noise (relative 1e-3: the logits differ by ~1e-5, KLD is a difference
of log-probabilities and keeps that relative size). The transformers backend always runs
on the CPU, so this is eval's one CUDA path."""

from __future__ import annotations

import pytest
import torch

from llmctl.eval.runner import EvalConfig, run_eval
from llmctl.eval.windows import Windowing
from tests.eval.conftest import perturb_copy
from tests.gpu.common import GPU, HAS_CUDA, record

pytestmark = GPU


def _eval(candidate, reference, cache_dir, kv_cache_dtype="auto") -> dict:
    config = EvalConfig(candidate=str(candidate), reference=str(reference), backend="serve",
                        kv_cache_dtype=kv_cache_dtype, windowing=Windowing(ctx=64, max_windows=4),
                        top_k=64, cache_dir=cache_dir)
    return run_eval(config)["metrics"]


def _on_cpu(monkeypatch) -> None:
    """What follows runs as on a machine without a GPU, and without the native CPU
    kernels (the CPU side needs no C++ compiler on the GPU machine)."""
    from llmctl.serve.kernels import cpu as cpu_kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LLMCTL_CPU_KERNELS", "0")
    cpu_kernels.load_variant.cache_clear()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_serve_backend_kld_on_cuda_equals_the_cpus(tiny_llama, tmp_path, monkeypatch,
                                                   kv_cache_dtype):
    perturbed = perturb_copy(tiny_llama, tmp_path / "perturbed", 0.03)
    on_device = _eval(perturbed, tiny_llama, tmp_path / "cache-dev", kv_cache_dtype)
    _on_cpu(monkeypatch)
    on_cpu = _eval(perturbed, tiny_llama, tmp_path / "cache-cpu", kv_cache_dtype)
    record(f"eval[{kv_cache_dtype}]", cuda=HAS_CUDA, kld_device=on_device["mean_kld"],
           kld_cpu=on_cpu["mean_kld"], ppl_device=on_device["ppl"], ppl_cpu=on_cpu["ppl"])
    assert on_device["mean_kld"] > 0.01  # the perturbation is seen
    assert on_device["mean_kld"] == pytest.approx(on_cpu["mean_kld"], rel=1e-3)
    assert on_device["ppl"] == pytest.approx(on_cpu["ppl"], rel=1e-4)
    assert on_device["same_top_p"] == pytest.approx(on_cpu["same_top_p"], abs=0.02)
