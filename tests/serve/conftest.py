"""Fixtures for the engine tests: tiny model variants and transformers references."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.serve.paged_cases import ISA_VARIANTS

PROMPTS = [
    "The file object",
    "In Python, a class is a blueprint for objects and",
    "x",
    ("Lambda expressions (sometimes called lambda forms) are used to create anonymous "
     "functions. The expression lambda parameters: expression yields a function object."),
    "The import statement",
    "A",
]


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    from llmctl.models.loading import load_model

    return load_model(Path(path))


@functools.lru_cache(maxsize=8)
def tokenizer(path: str):
    from llmctl.models.loading import load_tokenizer

    return load_tokenizer(Path(path))


@functools.lru_cache(maxsize=256)
def _hf_greedy(path: str, ids: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    from llmctl.models.hf_generate import hf_generate

    return tuple(hf_generate(hf_model(path), tokenizer(path), list(ids), max_tokens=max_tokens))


def hf_greedy(path, ids: list[int], max_tokens: int) -> list[int]:
    """transformers ``generate`` (greedy, batch of one, stops at EOS), memoised."""
    return list(_hf_greedy(str(path), tuple(ids), max_tokens))


def encode(path, text: str) -> list[int]:
    return tokenizer(str(path))(text)["input_ids"]


def assert_all_blocks_free(engine) -> None:
    bm = engine.block_manager
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.fixture(params=ISA_VARIANTS)
def isa(request, monkeypatch):
    """The kernel accessors return one instruction-set variant's kernels for this test."""
    from llmctl.serve.kernels import cpu as cpu_kernels

    monkeypatch.setenv(cpu_kernels.VARIANT_ENV, request.param)
    return request.param


@pytest.fixture
def kernels_off(monkeypatch):
    """The pure-torch paths: the native CPU kernels switched off for one test."""
    from llmctl.serve.kernels import cpu as cpu_kernels

    monkeypatch.setenv("LLMCTL_CPU_KERNELS", "0")
    cpu_kernels.load_variant.cache_clear()
    yield
    cpu_kernels.load_variant.cache_clear()


@pytest.fixture(scope="session")
def tiny_variants(tmp_path_factory):
    """``make(name, **config)``: tiny checkpoints of other families / RoPE variants."""
    from tests.tiny import build_tiny_llama

    root = tmp_path_factory.mktemp("tiny-variants")
    built: dict[str, Path] = {}

    def make(name: str, **kwargs) -> Path:
        if name not in built:
            built[name] = build_tiny_llama(root / name, **kwargs)
        return built[name]

    return make


@pytest.fixture(scope="session")
def tiny_draft(tiny_variants) -> Path:
    """A different random 1-layer model with the same tokenizer: a draft for tiny_llama."""
    return tiny_variants("draft", seed=7, layers=1)
