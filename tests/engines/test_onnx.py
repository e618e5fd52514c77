import json

import numpy as np
import pytest

from llmctl.engines.engine_dir import open_engine
from llmctl.errors import ResourceError
from llmctl.eval.metrics import log_softmax
from tests.engines.conftest import PROMPTS, hf_greedy, hf_logits


def test_fp32_greedy_matches_transformers_for_32_tokens(onnx_fp32, hf_tiny):
    engine = open_engine(onnx_fp32, threads=1)
    outs = engine.generate(PROMPTS, max_tokens=32, ignore_eos=True)  # one decode batch
    for prompt, out in zip(PROMPTS, outs):
        assert out == hf_greedy(hf_tiny, prompt, 32)


def test_fp32_logits_within_tolerance(onnx_fp32, hf_tiny):
    engine = open_engine(onnx_fp32, threads=1)
    ids = PROMPTS[2] + PROMPTS[0]
    got, want = engine.logits(ids), hf_logits(hf_tiny, ids)
    assert got.shape == want.shape == (len(ids), 512)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    lp = engine.token_logprobs(ids)
    ref = log_softmax(want)[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(lp, ref, atol=1e-4)


def test_provider_actually_running_is_reported(onnx_fp32):
    engine = open_engine(onnx_fp32)
    assert engine.provider == "CPUExecutionProvider"
    info = engine.describe()
    assert info["active_providers"] == ["CPUExecutionProvider"]


def test_cuda_request_without_cuda_falls_back_visibly_or_refuses(onnx_fp32):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime offers CUDA")
    engine = open_engine(onnx_fp32, device="cuda")
    assert engine.describe()["requested_provider"] == "CUDAExecutionProvider"
    assert engine.provider == "CPUExecutionProvider"
    with pytest.raises(ResourceError, match="runs this engine on CPUExecutionProvider"):
        open_engine(onnx_fp32, device="cuda", strict_provider=True)


def test_int4_graph_uses_matmulnbits_and_reports_kld(onnx_int4, hf_tiny, record_property):
    manifest = json.loads((onnx_int4 / "llmctl-engine.json").read_text())
    info = manifest["target_info"]
    assert info["matmul_nbits"]["bits"] == 4 and info["matmul_nbits"]["block_size"] == 32
    assert info["ops"]["MatMulNBits"] >= 2 * 4 and "MatMul" not in info["ops"]
    engine = open_engine(onnx_int4, threads=1)
    ids = PROMPTS[2] * 4
    p = log_softmax(hf_logits(hf_tiny, ids))
    q = log_softmax(engine.logits(ids))
    kld = float(np.mean(np.sum(np.exp(p) * (p - q), axis=-1)))
    record_property("int4_kld", kld)
    print(f"int4 ONNX KLD vs source: {kld:.4f} nats/token")
    # quantized: not the same distribution, but far closer than an unrelated one
    uniform = float(np.mean(np.sum(np.exp(p) * (p + np.log(512)), axis=-1)))
    assert 0.0 < kld < 0.25 * uniform
