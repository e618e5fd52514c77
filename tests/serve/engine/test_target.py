"""The engine's model comes from a ``Target`` (llmctl.serve.engine.target): a checkpoint
by default (llmctl.serve.engine.loader), anything else handed to ``LLMEngine(config,
target)``; the stats it reports are an ``EngineStats``."""

from __future__ import annotations

import torch

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.config import make_engine_config
from llmctl.serve.engine.llm_engine import LLMEngine
from llmctl.serve.engine.loader import CheckpointTarget
from llmctl.serve.engine.stats import EngineStats
from llmctl.serve.engine.target import Target

TARGET_MEMBERS = (*Target.__annotations__, "perf_cost", "fallback_eos_ids")


def assert_is_target(target) -> None:
    """Everything the Target protocol names is there (the engine asks for nothing else)."""
    missing = [name for name in TARGET_MEMBERS if not hasattr(target, name)]
    assert not missing, f"{type(target).__name__} lacks {missing}"


def test_the_default_target_is_the_checkpoint(tiny_llama):
    engine = LLMEngine.from_args(str(tiny_llama), kv_cache_memory="8MiB")
    target = engine.target
    assert isinstance(target, CheckpointTarget)
    assert_is_target(target)
    assert target.dtype == torch.float32 and engine.perf_dtype == "fp32"
    assert target.serves_prompt_logprobs and target.serves_loras and engine.loras is not None
    assert (engine.runner, engine.spec, engine.kv_plan) == (target.runner, target.spec,
                                                            target.plan)
    cost = target.perf_cost()
    assert cost is not None and cost[1] == float(target.model.bytes_read_per_step)


def test_a_given_target_is_served(tiny_llama):
    config = make_engine_config(str(tiny_llama), kv_cache_memory="8MiB")
    target = CheckpointTarget(config)
    engine = LLMEngine(config, target)
    assert engine.target is target and engine.tokenizer is target.tokenizer
    engine.add_request("r", [5, 17, 33], SamplingParams(max_tokens=3, temperature=0,
                                                        ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert isinstance(stats, EngineStats)
    assert (stats.num_running, stats.num_requests_finished, stats.generation_tokens) == (0, 1, 3)
    assert stats.prompt_tokens == 3 and stats.engine_restarts is None
