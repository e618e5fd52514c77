"""``llmctl serve ENGINE_DIR``: an ONNX / torch-compile engine behind the HTTP API, with
greedy output over HTTP equal to the offline engine on the source checkpoint."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from typer.testing import CliRunner

from llmctl.cli.app import build_app
from tests.engines.conftest import incompatible_copy
from tests.serve.api.conftest import start_server
from tests.serve.engine.test_target import assert_is_target

PROMPTS = [[5, 17, 33, 99, 100, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49] * 3,
           "hello world"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Greedy outputs of llmctl's own engine on the source checkpoint: token ids and
    text (the detokenizer holds back an incomplete UTF-8 tail, so text is compared with
    its text, not with tokenizer.decode)."""
    from llmctl.serve.core.sampling_params import SamplingParams
    from llmctl.serve.engine.llm import LLM

    llm = LLM(str(tiny_llama), kv_cache_memory="32MiB")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                ignore_eos=True))
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs], llm.tokenizer


@pytest.fixture(scope="module")
def served_onnx(onnx_fp32):
    # max_num_batched_tokens 16: the 30-token prompt is prefilled in two chunks
    running = start_server(str(onnx_fp32), served_model_name=None, num_threads=1,
                           max_num_batched_tokens=16)
    yield running
    running.stop()


def _complete(url: str, prompt, **extra) -> dict:
    body = {"model": "onnx-fp32", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "logprobs": 1, **extra}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _check(choice: dict, want: tuple[list[int], str], tokenizer) -> None:
    ids, text = want
    assert len(ids) == MAX_TOKENS
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert choice["text"] == text


def test_models_endpoint_names_the_engine_directory(served_onnx, onnx_fp32):
    data = httpx.get(served_onnx.url + "/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["onnx-fp32", str(onnx_fp32)]
    assert data[0]["max_model_len"] == served_onnx.server.config.model.max_model_len


def test_an_engine_directory_in_an_engine_process(onnx_fp32, reference):
    """The engine process registers engine directories as the CLI does (llmctl.engines),
    and the same aliases and tokens come back through the pipe."""
    want, tokenizer = reference
    running = start_server(str(onnx_fp32), served_model_name=None, num_threads=1,
                           max_num_batched_tokens=16, engine_process=True)
    try:
        data = httpx.get(running.url + "/v1/models").json()["data"]
        assert [m["id"] for m in data] == ["onnx-fp32", str(onnx_fp32)]
        for prompt, ids in zip(PROMPTS, want):
            _check(_complete(running.url, prompt)["choices"][0], ids, tokenizer)
    finally:
        running.stop()


def test_greedy_over_http_equals_offline_engine_on_source(served_onnx, reference):
    want, tokenizer = reference
    for prompt, ids in zip(PROMPTS, want):
        out = _complete(served_onnx.url, prompt)
        assert out["usage"]["completion_tokens"] == MAX_TOKENS
        _check(out["choices"][0], ids, tokenizer)


def test_streaming_yields_the_same_tokens(served_onnx, reference):
    want, _ = reference
    body = {"model": "onnx-fp32", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    chunks = []
    with httpx.stream("POST", served_onnx.url + "/v1/completions", json=body,
                      timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert len(chunks) >= 2 and text == want[0][1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_two_concurrent_requests_complete(served_onnx, reference):
    want, tokenizer = reference
    results: dict[int, dict] = {}

    def go(i: int) -> None:
        results[i] = _complete(served_onnx.url, PROMPTS[i])

    threads = [threading.Thread(target=go, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == [0, 1]
    for i in (0, 1):
        _check(results[i]["choices"][0], want[i], tokenizer)


def test_chat_runs_on_the_engine_directory(served_onnx):
    body = {"model": "onnx-fp32", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    out = httpx.post(served_onnx.url + "/v1/chat/completions", json=body, timeout=120)
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["completion_tokens"] == 4


def test_eval_through_the_server_matches_the_source(served_onnx, tiny_llama, tmp_path):
    """Prompt log-probs (echo + logprobs) come from the engine directory's runtime:
    ``llmctl eval openai:URL`` against the served engine agrees with the source model."""
    from llmctl.eval.runner import EvalConfig, run_eval
    from llmctl.eval.windows import Windowing

    report = run_eval(EvalConfig(candidate=f"openai:{served_onnx.url}",
                                 reference=str(tiny_llama), top_k=16, cache_dir=tmp_path,
                                 windowing=Windowing(ctx=48, max_windows=2)))
    m = report["metrics"]
    assert report["metadata"]["candidate"]["model"] == "onnx-fp32"
    assert abs(m["mean_kld"]) < 1e-4 and m["same_top_p"] == 1.0


# --- engine settings ---------------------------------------------------------------------


def test_prefix_caching_is_forced_off_with_a_warning_and_draft_models_refused(onnx_fp32):
    from llmctl.engines.serve_engine import open_serving_engine
    from llmctl.errors import UsageError

    warnings: list[str] = []
    engine = open_serving_engine(onnx_fp32, warn=warnings.append, enable_prefix_caching=True,
                                 dtype="bfloat16", kv_cache_memory="8MiB")
    assert not engine.config.enable_prefix_caching
    assert not engine.block_manager.enable_prefix_caching
    assert any("prefix caching is off" in w for w in warnings)
    assert any("--dtype is ignored" in w for w in warnings)
    with pytest.raises(UsageError, match="draft model"):
        open_serving_engine(onnx_fp32, speculative={"method": "draft", "draft_model": "x"})


def test_torch_compile_engine_with_ngram_speculation(torch_compiled, tiny_llama, reference):
    """The compiled engine's max_seq_len (128) caps the context; ngram drafts verify."""
    from llmctl.engines.serve_engine import open_serving_engine
    from llmctl.serve.core.sampling_params import SamplingParams

    want, _ = reference
    engine = open_serving_engine(torch_compiled, kv_cache_memory="8MiB", num_threads=1,
                                 max_num_batched_tokens=16,
                                 speculative={"method": "ngram", "num_speculative_tokens": 3})
    assert engine.max_model_len == 128
    for i in (0, 1):
        engine.add_request(f"r{i}", PROMPTS[i], SamplingParams(max_tokens=MAX_TOKENS,
                                                               temperature=0, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done["r0"], done["r1"]] == [ids for ids, _ in want[:2]]
    assert engine.stats().spec_verify_steps > 0
    # the engine directory is the engine's target: no torch model, metering or adapters
    assert_is_target(engine.target)
    assert engine.target.describe().startswith(f"serving engine directory {torch_compiled}")
    assert engine.perf_dtype == "unknown" and engine.loras is None


# --- the command line ----------------------------------------------------------------------

runner = CliRunner()


def test_serve_refuses_an_engine_built_for_another_machine(onnx_fp32, tmp_path):
    copy = incompatible_copy(onnx_fp32, tmp_path)
    result = runner.invoke(build_app(), ["serve", str(copy), "--port", "0"])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 2, result.output  # one error line and its hint, no traceback
    assert lines[0].startswith("error: this onnx engine cannot load here: it was built for")
    assert "rebuild it on this machine: llmctl build-engine" in lines[1]


def test_serve_refuses_handoff_engines_and_draft_models_for_engine_dirs(onnx_fp32):
    app = build_app()
    result = runner.invoke(app, ["serve", str(onnx_fp32), "--engine", "vllm"])
    assert result.exit_code == 2 and "is an engine directory" in result.output
    result = runner.invoke(app, ["serve", str(onnx_fp32), "--speculative", "draft",
                                 "--draft-model", "smollm2-135m"])
    assert result.exit_code == 2 and "draft model" in result.output


def test_serve_help_says_engine_directories_are_served():
    result = runner.invoke(build_app(), ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = " ".join(result.output.replace("│", " ").split())
    assert "an engine directory from `llmctl build-engine`" in text
    assert "prefix caching off" in text


def test_eval_scores_the_torch_compile_engine_against_its_source(torch_compiled, tiny_llama,
                                                                  tmp_path):
    """(Here rather than in tests/eval: the compiled engine is built once, for tests/engines.)"""
    from llmctl.errors import ConfigError
    from llmctl.eval.runner import EvalConfig, run_eval
    from llmctl.eval.windows import Windowing

    report = run_eval(EvalConfig(candidate=str(torch_compiled), reference=str(tiny_llama),
                                 windowing=Windowing(ctx=48, max_windows=2), top_k=16,
                                 cache_dir=tmp_path, threads=1))
    m = report["metrics"]
    assert report["metadata"]["candidate"]["target"] == "torch-compile"
    assert abs(m["mean_kld"]) < 1e-4 and m["same_top_p"] == 1.0
    with pytest.raises(ConfigError, match="exceeds the 128 this engine was built for"):
        run_eval(EvalConfig(candidate=str(torch_compiled), data="builtin:pydoc-heldout",
                            windowing=Windowing(ctx=200, max_windows=1), cache_dir=tmp_path))


def test_serve_passes_only_settings_the_user_gave(onnx_fp32, monkeypatch):
    """Defaults (prefix caching on, float32) are not requests to warn about; flags are."""
    from llmctl.engines.serve_engine import engine_dir_settings
    from llmctl.serve.launch import assemble as launch

    seen = []
    monkeypatch.setattr(launch, "run_server", lambda opts, ready=None: seen.append(opts) or 0)
    app = build_app()
    assert runner.invoke(app, ["serve", str(onnx_fp32)]).exit_code == 0
    assert runner.invoke(app, ["serve", str(onnx_fp32), "--prefix-caching"]).exit_code == 0
    quiet, asked = seen[0].engine_kwargs, seen[1].engine_kwargs
    assert "enable_prefix_caching" not in quiet and "dtype" not in quiet
    assert asked["enable_prefix_caching"] is True
    warnings: list[str] = []
    assert engine_dir_settings(onnx_fp32, quiet, warnings.append)["enable_prefix_caching"] is False
    assert warnings == []
    engine_dir_settings(onnx_fp32, asked, warnings.append)
    assert len(warnings) == 1 and "prefix caching is off" in warnings[0]


_FRESH_SERVE = """
import sys

from typer.testing import CliRunner

from llmctl.cli.app import build_app
from llmctl.serve.launch import assemble as launch
from llmctl.serve.engine.sources import source_for

assert "llmctl.engines" not in sys.modules, "the serve layer imported llmctl.engines"
launch.run_server = lambda opts, ready=None: print("source:", source_for(opts.model).name) or 0
result = CliRunner().invoke(build_app(), ["serve", sys.argv[1]])
print(result.output, result.exception)
"""


def test_cli_serve_registers_engine_directories_in_a_fresh_interpreter(tmp_path):
    """llmctl.serve never imports llmctl.engines (tests/test_import_graph.py); the engine
    directory source exists only because the CLI imports llmctl.engines. A fresh process
    shows that happens before MODEL is opened (this test module has imported it already)."""
    import subprocess
    import sys

    from llmctl.engines.manifest import MANIFEST_NAME
    from tests.test_import_graph import ROOT

    (tmp_path / MANIFEST_NAME).write_text("{}")  # claiming reads no more than this
    proc = subprocess.run([sys.executable, "-c", _FRESH_SERVE, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "source: engine-dir" in proc.stdout, proc.stdout + proc.stderr[-2000:]
