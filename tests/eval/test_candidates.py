"""Candidate adapters: registry, GGUF through llama.cpp or transformers, engine dirs."""

from __future__ import annotations

import importlib.util

import pytest

from llmctl.engines.manifest import NotAnEngineError
from llmctl.errors import MissingDependencyError
from llmctl.eval.candidates import (
    REGISTRY,
    CandidateOptions,
    HFCandidate,
    LlamaCppCandidate,
    OpenAIServerCandidate,
    open_candidate,
)
from llmctl.eval.runner import EvalConfig, run_eval
from llmctl.eval.windows import Windowing

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


def test_registry_routes_specs(tiny_llama, tiny_gguf):
    assert set(REGISTRY) >= {"hf", "gguf", "openai", "engine"}
    assert OpenAIServerCandidate.matches("openai:http://127.0.0.1:1")
    assert OpenAIServerCandidate.matches("http://127.0.0.1:8000/v1")
    assert LlamaCppCandidate.matches(str(tiny_gguf)) and not LlamaCppCandidate.matches(str(tiny_llama))
    assert isinstance(open_candidate(str(tiny_llama)), HFCandidate)
    with pytest.raises(NotAnEngineError, match="build-engine"):
        open_candidate("engine:/some/dir")


def test_gguf_without_llama_cpp_says_how_to_proceed(tiny_gguf, monkeypatch):
    from llmctl.gguf import llamacpp

    monkeypatch.setattr(llamacpp, "available", lambda: False)
    with pytest.raises(MissingDependencyError) as err:
        open_candidate(str(tiny_gguf))
    assert "llama-cpp-python" in err.value.remedy and "--backend transformers" in err.value.remedy


def test_gguf_through_transformers_matches_its_source(tiny_llama, tiny_gguf, eval_cache):
    # The F32 export of the tiny model, imported back: the same function, KLD ~ 0.
    report = run_eval(EvalConfig(candidate=str(tiny_gguf), reference=str(tiny_llama),
                                 backend="transformers", windowing=Windowing(ctx=48, max_windows=2),
                                 top_k=16, cache_dir=eval_cache))
    assert report["metadata"]["candidate"]["source"] == "gguf"
    assert report["metrics"]["mean_kld"] < 1e-6 and report["metrics"]["same_top_p"] == 1.0


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed")
def test_gguf_through_llama_cpp(tiny_llama, tiny_gguf, eval_cache):
    report = run_eval(EvalConfig(candidate=str(tiny_gguf), reference=str(tiny_llama),
                                 windowing=Windowing(ctx=48, max_windows=2), top_k=16,
                                 cache_dir=eval_cache, threads=1))
    m = report["metrics"]
    assert report["metadata"]["candidate"]["kind"] == "gguf"
    # llama.cpp's F32 kernels against torch's: rounding-level differences only.
    assert m["mean_kld"] < 1e-3 and m["same_top_p"] > 0.95
    assert m["ppl_ratio"] == pytest.approx(1.0, abs=0.01)


def test_options_reject_unknown_backend(tiny_llama):
    from llmctl.errors import ConfigError

    with pytest.raises(ConfigError, match="backend"):
        open_candidate(str(tiny_llama), CandidateOptions(backend="magic"))
