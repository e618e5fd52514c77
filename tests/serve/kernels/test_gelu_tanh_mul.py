"""GeGLU's ``gelu(gate, approximate="tanh") * up`` (csrc/norm_act.cpp's gelu_tanh_mul_bf16)
against torch's bf16 ops, in every instruction-set variant this CPU runs, and which fused
activation :meth:`NormActKernels.act_mul` hands out for an HF activation name.

Tolerance against torch's bf16 result: both round GeLU to bf16, then the product to
bf16, from the same float32 formula; the kernel's tanh (from exp in the vector bodies,
std::tanh in the tail) and torch's (Sleef) differ in the last float32 bits. Where
``1 + tanh`` cancels (gate below about -2, outputs under 1e-2) that moves the bf16 result
by a step now and then: measured here 0.5 % of outputs differ, none with |output| >= 1e-2,
the largest difference 2.2e-6. The test allows 1 % differing outputs, 0.1 % of those with
|output| >= 1e-2, and each output within 1e-5 + 2^-7 relative (one bf16 step).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmctl.serve.kernels import cpu as cpu_kernels
from tests.serve.paged_cases import needs_kernels


def _ops() -> cpu_kernels.NormActKernels:
    return cpu_kernels.norm_act_kernels(torch.device("cpu"), torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 33])  # 33: the multi-threaded branch
@pytest.mark.parametrize("width", [128, 1000, 2307])  # tails past the 16- and 8-lane loops
def test_gelu_tanh_mul_matches_torch_bf16(rows, width, isa):
    gen = torch.Generator().manual_seed(width + rows)
    gate_up = (torch.randn((rows, 2 * width), generator=gen) * 4).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    ref = F.gelu(gate, approximate="tanh") * up
    out = _ops().gelu_tanh_mul(gate_up)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    differ = out != ref
    assert differ.float().mean().item() < 1e-2
    assert (differ & (ref.float().abs() >= 1e-2)).float().mean().item() < 1e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-5, rtol=2 ** -7)


@needs_kernels
def test_gelu_tanh_mul_rounds_gelu_before_the_product(isa):
    """The GeLU is rounded to bf16 before the product, as torch's two bf16 ops round: a
    kernel that multiplied the float32 GeLU would match far fewer outputs (over 10 %
    differ then, measured on these inputs)."""
    gen = torch.Generator().manual_seed(7)
    gate_up = (torch.randn((16, 2 * 512), generator=gen) * 3).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    once = (F.gelu(gate.float(), approximate="tanh") * up.float()).bfloat16()
    twice = F.gelu(gate, approximate="tanh") * up
    out = _ops().gelu_tanh_mul(gate_up)
    assert (out == twice).float().mean() > 0.99
    assert (once != twice).float().mean() > 0.1  # the inputs tell the two apart


@needs_kernels
def test_gelu_saturates_like_torch(isa):
    """Far from zero GeLU is x (large gate) or exactly 0 (very negative gate), as torch's."""
    gate = torch.tensor([-60.0, -20.0, -9.0, 0.0, 9.0, 20.0, 60.0, 300.0]).bfloat16()
    up = torch.full_like(gate, 1.5)
    out = _ops().gelu_tanh_mul(torch.cat([gate, up])[None])[0]
    ref = F.gelu(gate, approximate="tanh") * up
    assert torch.equal(out, ref)


@needs_kernels
def test_act_mul_names_the_fused_activations():
    ops = _ops()
    gate_up = torch.randn((3, 64), generator=torch.Generator().manual_seed(0)).bfloat16()
    for name in ("silu", "swish"):
        assert torch.equal(ops.act_mul(name)(gate_up), ops.silu_mul(gate_up))
    assert torch.equal(ops.act_mul("gelu_pytorch_tanh")(gate_up), ops.gelu_tanh_mul(gate_up))
    for name in ("gelu", "gelu_new", "relu", "tanh", ""):  # the caller's torch path
        assert ops.act_mul(name) is None
