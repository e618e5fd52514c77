"""``llmctl batch`` on the command line: exit codes 0 / 1 / 2, the summary, resuming."""

import json

import pytest
from typer.testing import CliRunner

from llmctl.cli.app import build_app

runner = CliRunner()
app = build_app()
ENGINE = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-num-seqs", "8"]


def _line(custom_id, body, url="/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def run(*args):
    return runner.invoke(app, ["batch", *map(str, args)])


def _usage_error(result, *words):
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and "Traceback" not in result.output
    for word in words:
        assert word in result.output, result.output


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([
        _line("a", {"prompt": "The file object", "max_tokens": 4, "temperature": 0,
                    "ignore_eos": True}),
        _line("b", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                    "temperature": 0, "ignore_eos": True}, "/v1/chat/completions"),
    ]) + "\n")
    return path


def test_all_lines_ok_exit_0_then_resume_does_nothing(tiny_llama, src, tmp_path):
    out = tmp_path / "out.jsonl"
    result = run(src, "-o", out, tiny_llama, *ENGINE, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (summary["lines"], summary["written"], summary["failed"]) == (2, 2, 0)
    assert summary["completion_tokens"] == 4 + 3 and summary["output_throughput"] > 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == ["a", "b"]
    assert {x["response"]["body"]["object"] for x in lines} == {"text_completion",
                                                                "chat.completion"}
    # the model is named as given on the command line (the server's default name)
    assert {x["response"]["body"]["model"] for x in lines} == {str(tiny_llama)}
    again = run(src, "-o", out, tiny_llama, "--json")
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["skipped"] == 2
    assert out.read_text().count("\n") == 2


def test_failed_lines_exit_1(tiny_llama, src, tmp_path):
    with src.open("a") as f:
        f.write(_line("c", {"prompt": "x", "model": "gpt-4o"}) + "\n{oops\n")
    out = tmp_path / "out.jsonl"
    result = run(src, "-o", out, tiny_llama, *ENGINE, "--served-model-name", "tiny")
    assert result.exit_code == 1, result.output
    assert "2 of 4 lines failed" in result.output
    lines = {x["custom_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert lines["c"]["response"]["status_code"] == 404
    assert lines[None]["error"]["code"] == "invalid_json_line"
    # failures already in the output keep the exit code on a resumed run
    assert run(src, "-o", out, tiny_llama).exit_code == 1


def test_usage_errors_exit_2_before_the_model_loads(src, tmp_path):
    _usage_error(run(tmp_path / "missing.jsonl", "-o", tmp_path / "o.jsonl", "no-such-model"),
                 "input file not found")
    _usage_error(run(src, "-o", tmp_path / "no-dir" / "o.jsonl", "no-such-model"),
                 "cannot write the output")
    _usage_error(run(src, "-o", src, "no-such-model"), "-o is the input file")
    _usage_error(run(src, "no-such-model"), "-o")  # -o is required


def test_duplicate_custom_ids_exit_2(tiny_llama, src, tmp_path):
    with src.open("a") as f:
        f.write(_line("a", {"prompt": "again"}) + "\n")
    out = tmp_path / "out.jsonl"
    _usage_error(run(src, "-o", out, tiny_llama), "custom_id 'a' is on lines 1 and 3")
    assert not out.exists() or out.read_text() == ""


def test_tool_choice_auto_takes_the_parser_flags(tiny_llama, tmp_path):
    """A line with tools and tool_choice "auto" fails (400 in its error body) unless the
    batch has vLLM's --enable-auto-tool-choice --tool-call-parser; with them the model's
    Llama 3 style call (forced by a schema on the tiny model) comes back as tool_calls."""
    from tests.serve.api.tools.test_tools import TIME, TOOLS

    call = {"type": "object", "properties": {"name": {"type": "string", "enum": ["get_time"]},
                                             "parameters": TIME},
            "required": ["name", "parameters"], "additionalProperties": False}
    src = tmp_path / "tools.jsonl"
    src.write_text(_line("t", {
        "messages": [{"role": "user", "content": "What time is it?"}], "tools": TOOLS,
        "tool_choice": "auto", "max_tokens": 60, "temperature": 0,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "call", "schema": call}}},
        "/v1/chat/completions") + "\n")
    off = tmp_path / "off.jsonl"
    assert run(src, "-o", off, tiny_llama, *ENGINE).exit_code == 1
    [line] = map(json.loads, off.read_text().splitlines())
    assert line["response"]["status_code"] == 400
    assert "--enable-auto-tool-choice" in line["response"]["body"]["error"]["message"]
    _usage_error(run(src, "-o", tmp_path / "x.jsonl", tiny_llama, "--enable-auto-tool-choice"),
                 "--enable-auto-tool-choice needs --tool-call-parser")
    on = tmp_path / "on.jsonl"
    result = run(src, "-o", on, tiny_llama, *ENGINE, "--enable-auto-tool-choice",
                 "--tool-call-parser", "llama3_json")
    assert result.exit_code == 0, result.output
    [line] = map(json.loads, on.read_text().splitlines())
    [choice] = line["response"]["body"]["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [tool_call] = choice["message"]["tool_calls"]
    assert tool_call["function"]["name"] == "get_time"
    assert json.loads(tool_call["function"]["arguments"])["tz"] in ("UTC", "CET")
