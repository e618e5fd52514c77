"""An OpenAI-compatible server as the candidate: prompt log-probs from a tiny in-test
server (FastAPI + uvicorn on 127.0.0.1, a free port) that computes them with transformers."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from llmctl.eval.runner import EvalConfig, run_eval
from llmctl.eval.windows import Windowing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _app(model_dir, token_ids_as_strings: bool):
    from fastapi import FastAPI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    app = FastAPI()
    name = lambda i: f"token_id:{i}" if token_ids_as_strings else tok.decode([i])

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "tiny", "object": "model"}]}

    @app.post("/v1/completions")
    def completions(body: dict):
        ids = list(body["prompt"])
        k = int(body.get("logprobs") or 0)
        with torch.no_grad():
            lp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        nxt = int(lp[-1].argmax())
        ids_all = ids + [nxt]
        token_lp, top = [None], [None]
        for e in range(1, len(ids_all)):
            row = lp[e - 1]
            token_lp.append(float(row[ids_all[e]]))
            values, idx = row.topk(k)
            top.append({name(int(i)): float(v) for v, i in zip(values, idx)})
        return {"id": "cmpl-1", "object": "text_completion", "model": "tiny",
                "choices": [{"index": 0, "text": tok.decode(ids_all), "finish_reason": "length",
                             "logprobs": {"tokens": [name(i) for i in ids_all],
                                          "token_logprobs": token_lp, "top_logprobs": top,
                                          "text_offset": [0] * len(ids_all)}}]}

    return app


@pytest.fixture(scope="module", params=[True, False], ids=["token-ids", "strings"])
def server(request, tiny_perturbed):
    pytest.importorskip("fastapi")
    uvicorn = pytest.importorskip("uvicorn")

    port = _free_port()
    config = uvicorn.Config(_app(tiny_perturbed, request.param), host="127.0.0.1", port=port,
                            log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    yield f"openai:http://127.0.0.1:{port}", request.param
    srv.should_exit = True
    thread.join(timeout=10)


def test_server_candidate_matches_the_local_model(server, tiny_llama, tiny_perturbed, eval_cache):
    url, token_ids = server
    common = {"reference": str(tiny_llama), "windowing": Windowing(ctx=48, max_windows=2),
              "top_k": 16, "cache_dir": eval_cache}
    local = run_eval(EvalConfig(candidate=str(tiny_perturbed), **common))["metrics"]
    report = run_eval(EvalConfig(candidate=url, **common))
    remote = report["metrics"]
    assert report["metadata"]["candidate"]["kind"] == "openai"
    assert remote["tokens_scored"] == local["tokens_scored"] == 2 * 47
    assert remote["ppl"] == pytest.approx(local["ppl"], rel=1e-4)
    assert remote["mean_dp"] == pytest.approx(local["mean_dp"], abs=1e-5)
    # The server reports its own top 20: exact KLD needs the reference's top 16 in it;
    # the rest is lumped, which can only lower the value.
    assert 0 < remote["mean_kld"] <= local["mean_kld"] * (1 + 1e-4)
    if token_ids:
        assert remote["same_top_p"] == pytest.approx(local["same_top_p"])
    else:  # token strings map back to ids ambiguously (several ids decode alike)
        assert remote["same_top_p"] == pytest.approx(local["same_top_p"], abs=0.05)
