"""The native q/k norm (csrc/norm_act.cpp's rms_norm_groups_bf16, NormActKernels.qk_norm)
against the layer loop's torch one, ``F.rms_norm(x, None, eps) * w`` in bf16, per head
(Qwen3, Gemma 3: a ``[heads + kv_heads, head_dim]`` table) and over each whole projection
(OLMo 2), on q/k as strided views of a fused qkv row; every instruction-set variant.

Tolerance: the same two bf16 roundings (``bf16(x * inv)``, then times the weight); the
float32 sum of squares runs in another order than torch's and 1/sqrt stands for rsqrt, so
``inv`` may differ in its last bit and a rare value's ``bf16(x * inv)`` lands one bf16
step away, which the weight's rounding can carry to just over 2^-7 of the output: under
1 % of values differ (measured here: none in the AVX-512 builds, 0.015 % in the AVX2 and
portable ones), each within 2^-6 relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmctl.serve.kernels import cpu as cpu_kernels
from tests.serve.paged_cases import needs_kernels

NH, NKV = 6, 2


def _qkv(tokens: int, d: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, (NH + 2 * NKV) * d, generator=gen) * 3).bfloat16()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16 and got.shape == want.shape and got.is_contiguous()
    assert (got != want).float().mean().item() < 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=2 ** -6)


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 3, 40])  # 40: the multi-threaded branch
@pytest.mark.parametrize("d", [16, 64, 128])
def test_per_head_qk_norm_matches_torch(tokens, d, isa):
    ops = cpu_kernels.norm_act_kernels(torch.device("cpu"), torch.bfloat16)
    qkv = _qkv(tokens, d, seed=d + tokens)
    qk = qkv[:, :(NH + NKV) * d]  # strided rows, as the layer loop slices them
    gen = torch.Generator().manual_seed(1)
    table = (torch.rand(NH + NKV, d, generator=gen) + 0.5).bfloat16()
    want = (F.rms_norm(qk.view(tokens, NH + NKV, d), (d,), None, 1e-6) * table)
    got = ops.qk_norm(qk, table, NH * d, d, True, 1e-6)
    _close(got, want.reshape(tokens, -1))
    assert torch.equal(qkv[:, :(NH + NKV) * d], qk)  # the input is left as it was


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 40])
def test_per_projection_qk_norm_matches_torch(tokens, isa):
    """OLMo 2: q over its heads * head_dim values, k over its own, one weight vector."""
    d = 64
    ops = cpu_kernels.norm_act_kernels(torch.device("cpu"), torch.bfloat16)
    qkv = _qkv(tokens, d, seed=tokens)
    q_size, k_size = NH * d, NKV * d
    qk = qkv[:, :q_size + k_size]
    w = (torch.rand(q_size + k_size, generator=torch.Generator().manual_seed(2)) + 0.5)
    w = w.bfloat16()
    want = torch.cat([F.rms_norm(qk[:, :q_size], (q_size,), None, 1e-6) * w[:q_size],
                      F.rms_norm(qk[:, q_size:], (k_size,), None, 1e-6) * w[q_size:]], -1)
    _close(ops.qk_norm(qk, w, q_size, d, False, 1e-6), want)
