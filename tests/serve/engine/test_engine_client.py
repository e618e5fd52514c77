"""The engine interface AsyncEngine drives (llmctl.serve.engine.client.EngineClient):
the in-process engine and the engine processes both implement every member of it."""

from __future__ import annotations

import inspect

from llmctl.serve.engine.client import EngineClient


def members() -> set[str]:
    methods = {name for name, value in vars(EngineClient).items()
               if inspect.isfunction(value) and not name.startswith("_")}
    return methods | set(EngineClient.__annotations__)


def test_the_protocol_names_what_async_engine_calls():
    assert {"add_request", "abort_request", "has_unfinished_requests", "step", "stats",
            "admission_key", "queue_key", "wait_bound", "lora_names", "add_lora",
            "remove_lora", "tokenizer", "max_model_len", "spec"} == members()


def test_process_engine_implements_it():
    from llmctl.serve.proc.engine import ProcessEngine

    missing = [name for name in members() if not hasattr(ProcessEngine, name)]
    assert not missing
    for name in members() - set(EngineClient.__annotations__):  # same keyword arguments
        ours = inspect.signature(getattr(ProcessEngine, name)).parameters
        wanted = inspect.signature(getattr(EngineClient, name)).parameters
        assert set(wanted) - {"who"} <= set(ours), name


def test_the_in_process_engine_implements_it(tiny_llama):
    from llmctl.serve.engine.llm import LLM

    engine = LLM(str(tiny_llama), max_model_len=64, kv_cache_memory="8MiB").engine
    assert isinstance(engine, EngineClient)
