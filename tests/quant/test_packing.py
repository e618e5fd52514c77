"""int32 packing: exact round trips and the compressed-tensors bit layout."""

import pytest
import torch

from llmctl.quant.packing import pack_int32, unpack_int32


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("shape", [(3, 64), (5, 100), (7, 33), (2, 1)])
@pytest.mark.parametrize("dim", [0, 1])
def test_round_trip_is_exact(bits, shape, dim):
    torch.manual_seed(bits)
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), shape, dtype=torch.int8)
    packed = pack_int32(q, bits, dim)
    assert packed.dtype == torch.int32
    n = shape[dim]
    assert packed.shape[dim] == -(-n * bits // 32)  # ceil(n * bits / 32) words, no waste
    assert torch.equal(unpack_int32(packed, bits, shape, dim), q)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_bit_exact_with_compressed_tensors(bits, dim):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    torch.manual_seed(0)
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (48, 96), dtype=torch.int8)
    assert torch.equal(pack_int32(q, bits, dim), helpers.pack_to_int32(q, bits, dim))


def test_int4_layout_low_nibble_first():
    # codes -8..7 are stored offset by 8; element 0 in bits 0-3 of word 0
    q = torch.tensor([[-8, -7, 0, 7, 1, 2, 3, 4]], dtype=torch.int8)
    word = pack_int32(q, 4)[0, 0].item() & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [0, 1, 8, 15, 9, 10, 11, 12]


def test_rejects_non_int8_codes():
    with pytest.raises(ValueError):
        pack_int32(torch.zeros(2, 8, dtype=torch.int32), 4)
