"""MXFP4 decoding against transformers' reference (``convert_moe_packed_tensors``)."""

from __future__ import annotations

import pytest
import torch

from llmctl.quant import mxfp4


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns (NaN-safe, -0.0 distinct from +0.0)."""
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16,
                   torch.float16: torch.int16}[t.dtype])


def test_the_value_table_is_transformers():
    from transformers.integrations.mxfp4 import FP4_VALUES

    assert list(mxfp4.FP4_VALUES) == FP4_VALUES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_is_bit_exact_with_transformers(dtype):
    """Random codes and every scale 0..255 (subnormal, overflowing and NaN-producing
    extremes included): the same bits as transformers' decoding, in its [E, K, rows]
    layout transposed back."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    experts, rows, groups = 3, 40, 4
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=gen,
                           dtype=torch.uint8)
    scales = torch.randint(0, 256, (experts, rows, groups), generator=gen, dtype=torch.uint8)
    scales.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    ours = mxfp4.dequantize(blocks, scales, dtype)
    assert ours.shape == (experts, rows, groups * 32) and ours.dtype == dtype
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
    assert torch.equal(_bits(ours), _bits(theirs.contiguous()))
    chunked = mxfp4.dequantize(blocks, scales, dtype, rows_per_chunk=7)
    assert torch.equal(_bits(chunked), _bits(ours))


def test_typical_scales_decode_to_the_table_times_a_power_of_two():
    blocks = torch.tensor([[[0x10 * hi + lo for lo, hi in zip(range(0, 16, 2), range(1, 16, 2))]
                            * 2]], dtype=torch.uint8)
    out = mxfp4.dequantize(blocks, torch.tensor([[128]], dtype=torch.uint8), torch.float32)
    assert out[0, :16].tolist() == [2 * v for v in mxfp4.FP4_VALUES]


def test_quantize_round_trips_the_representable_values_and_bounds_the_error():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(2, 8, 64, generator=gen)
    blocks, scales = mxfp4.quantize(w)
    assert blocks.shape == (2, 8, 2, 16) and scales.shape == (2, 8, 2)
    decoded = mxfp4.dequantize(blocks, scales, torch.float32)
    # the block's largest value scales into [4, 8): codes 4 and 6 are 2 scales apart, and
    # past 6 it saturates at 6: within 2 scales of w, at most
    scale = torch.pow(2.0, scales.float() - 127).repeat_interleave(32, -1)
    assert ((decoded - w).abs() <= 2 * scale).all()
    assert ((decoded - w).abs() / w.abs().amax(-1, keepdim=True)).mean() < 0.05
    again = mxfp4.quantize(decoded)
    assert torch.equal(mxfp4.dequantize(*again, torch.float32), decoded)


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="do not match"):
        mxfp4.dequantize(torch.zeros(2, 3, 16, dtype=torch.uint8),
                         torch.zeros(2, 4, dtype=torch.uint8))
