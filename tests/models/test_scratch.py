"""The reused buffers of :mod:`llmctl.models.layers.scratch`, and the grouped expert
computation taking its ``[T * k, H]`` buffers from them: the same numbers bit for bit as
allocating them, step after step, and nothing returned that a later step overwrites."""

from __future__ import annotations

import pytest
import torch

from llmctl.models.layers.mlp import fused_gated
from llmctl.models.layers.moe import Routing, grouped_experts, route
from llmctl.models.layers.scratch import Scratch

CPU = torch.device("cpu")


def test_a_buffer_grows_to_the_largest_request_and_is_handed_out_again():
    scratch = Scratch()
    big = scratch.take("rows", (8, 16), torch.bfloat16, CPU)
    small = scratch.take("rows", (3, 16), torch.bfloat16, CPU)
    assert small.shape == (3, 16) and small.data_ptr() == big.data_ptr()
    bigger = scratch.take("rows", (9, 16), torch.bfloat16, CPU)
    assert bigger.shape == (9, 16) and scratch.nbytes == 9 * 16 * 2
    assert scratch.take("rows", (2, 16), torch.bfloat16, CPU).data_ptr() == bigger.data_ptr()
    # another dtype or name is another buffer
    assert scratch.take("rows", (2, 16), torch.float32, CPU).dtype == torch.float32
    assert scratch.take("out", (2, 16), torch.float32, CPU).data_ptr() != \
        scratch.take("rows", (2, 16), torch.float32, CPU).data_ptr()


@pytest.mark.parametrize("dtype,float32_weights", [(torch.float32, False),
                                                    (torch.bfloat16, False),
                                                    (torch.bfloat16, True)])
def test_grouped_experts_from_scratch_equal_fresh_buffers_bit_for_bit(dtype, float32_weights):
    """Steps of 37, 5 and 64 tokens (Mixtral's float32 routing weights promote the
    weighted rows to float32: a buffer of its own dtype)."""
    torch.manual_seed(0)
    e, k, h, i = 8, 2, 32, 24
    routing = Routing(e, k, True, float32_weights)
    router = torch.randn(e, h).to(dtype)
    gate_up = (torch.randn(e, 2 * i, h) * 0.3).to(dtype)
    down = (torch.randn(e, h, i) * 0.3).to(dtype)
    act = fused_gated("silu")
    scratch = Scratch()
    results = []
    for t in (37, 5, 64):
        x = torch.randn(t, h).to(dtype)
        weights, experts = route(torch.nn.functional.linear(x, router), routing)
        want = grouped_experts(x, weights, experts, gate_up, down, act)
        got = grouped_experts(x, weights, experts, gate_up, down, act, scratch=scratch)
        assert torch.equal(got, want)
        results.append((got, got.clone()))
    # the returned sums are the caller's: later steps overwrote the scratch, not them
    assert all(torch.equal(got, kept) for got, kept in results)
    # four buffers of the largest step: rows and expert outputs in the model's dtype, the
    # weighted rows and their gather in the routing weights' promotion
    wide = torch.float32 if float32_weights else dtype
    assert scratch.nbytes == 64 * k * h * 2 * (dtype.itemsize + wide.itemsize)
