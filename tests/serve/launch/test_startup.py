"""``llmctl serve`` settings -> engine configuration (llmctl.serve.launch.startup)."""

import pytest

from llmctl.errors import UsageError
from llmctl.serve.launch.startup import ServeSettings, check, engine_kwargs


def test_engine_directories_get_only_what_the_user_gave():
    quiet = engine_kwargs(ServeSettings(model="e"), engine_dir=True)
    assert "dtype" not in quiet and "enable_prefix_caching" not in quiet
    asked = engine_kwargs(ServeSettings(model="e", dtype="float32", prefix_caching=True,
                                        given=frozenset({"dtype", "prefix_caching"})),
                          engine_dir=True)
    assert asked["dtype"] == "float32" and asked["enable_prefix_caching"] is True


def test_checkpoints_get_a_concrete_dtype(monkeypatch):
    from llmctl.utils import device

    monkeypatch.setattr(device, "cuda_available", lambda: False)
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx2"}))
    assert engine_kwargs(ServeSettings(model="m"), engine_dir=False)["dtype"] == "float32"
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    kwargs = engine_kwargs(ServeSettings(model="m", speculative="ngram"), engine_dir=False)
    assert kwargs["dtype"] == "bfloat16" and kwargs["speculative"]["method"] == "ngram"


def test_unknown_engine_is_refused():
    with pytest.raises(UsageError, match="unknown engine 'tgi'"):
        check(ServeSettings(model="m", engine="tgi"))


def test_tool_call_flags_follow_vllm():
    from typing import get_args

    from llmctl.cli.serve import ToolCallParser
    from llmctl.serve.handoff.engines import HandoffOptions, refuse_unsupported, vllm_command
    from llmctl.serve.launch.startup import auto_tool_parser
    from llmctl.serve.openai.tools.parsers import AUTO_PARSERS

    # the CLI's choices are the parsers table
    assert set(get_args(get_args(get_args(ToolCallParser)[0])[0])) == set(AUTO_PARSERS)
    on = ServeSettings(model="m", enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert auto_tool_parser(on) == "hermes"
    # a parser alone leaves auto off (vLLM's rule); auto without a parser is refused
    assert auto_tool_parser(ServeSettings(model="m", tool_call_parser="hermes")) is None
    with pytest.raises(UsageError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        check(ServeSettings(model="m", enable_auto_tool_choice=True))
    with pytest.raises(UsageError, match="unknown --tool-call-parser 'mistral'"):
        auto_tool_parser(ServeSettings(model="m", tool_call_parser="mistral"))
    # gpt-oss's calls come through the harmony reasoning parser: alone it finds none
    with pytest.raises(UsageError, match="add --reasoning-parser harmony"):
        auto_tool_parser(ServeSettings(model="m", enable_auto_tool_choice=True,
                                       tool_call_parser="openai"))
    for name in ("harmony", "openai_gptoss"):
        assert auto_tool_parser(ServeSettings(model="m", enable_auto_tool_choice=True,
                                              tool_call_parser="openai",
                                              reasoning_parser=name)) == "openai"
    # handed to vLLM, harmony is its openai_gptoss
    cmd = vllm_command(HandoffOptions(model_path="p", served_name="s", host="h", port=1,
                                      python=__import__("sys").executable,
                                      reasoning_parser="harmony"))
    assert cmd[-2:] == ["--reasoning-parser", "openai_gptoss"]
    # vLLM takes the same flags and names; trtllm-serve has none
    cmd = vllm_command(HandoffOptions(model_path="p", served_name="s", host="h", port=1,
                                      python=__import__("sys").executable,
                                      enable_auto_tool_choice=True,
                                      tool_call_parser="llama3_json"))
    assert cmd[-3:] == ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    with pytest.raises(UsageError, match="--tool-call-parser"):
        refuse_unsupported("trtllm", {"--tool-call-parser"})
