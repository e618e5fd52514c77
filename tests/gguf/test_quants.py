"""llmctl's legacy block quantizers are bit-exact against gguf-py's reference."""

import gguf
import numpy as np
import pytest

from llmctl.errors import UsageError
from llmctl.gguf.quants import QUANTS, LegacyBlock, quantize, quantized_nbytes


def _cases():
    rng = np.random.default_rng(0)
    normal = rng.standard_normal((64, 256)).astype(np.float32) * 0.05
    edge = rng.standard_normal((8, 128)).astype(np.float32)
    edge[0] = 0.0  # all-zero blocks: d = 0, the inverse must not be inf
    edge[1, :32] = 1.0  # constant block: max == min for Q4_1/Q5_1
    edge[2, :32] = -edge[2, :32]
    edge[3, 7] = -9.0  # the extreme value is negative: signed absmax
    edge[4, :32] = np.linspace(-1, 1, 32)  # exact halves after scaling (rounding ties)
    edge[5, :32] = np.float32(1e-8)  # tiny scales underflow in float16
    edge[6, :32] = np.float32(7e4)  # near float16's max
    heavy = (rng.standard_t(2, size=(16, 96)) * 0.02).astype(np.float32)  # outliers
    return {"normal": normal, "edge": edge, "heavy-tailed": heavy,
            "3-d": rng.standard_normal((2, 4, 64)).astype(np.float32)}


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 7e4 -> inf scales
@pytest.mark.parametrize("type_name", sorted(QUANTS))
@pytest.mark.parametrize("case", sorted(_cases()))
def test_bit_exact_against_gguf_py(type_name, case):
    x = _cases()[case]
    ours = quantize(x, type_name)
    reference = gguf.quants.quantize(x, gguf.GGMLQuantizationType[type_name])
    assert ours.dtype == np.uint8 and ours.shape == reference.shape
    np.testing.assert_array_equal(ours, reference)


@pytest.mark.parametrize("type_name", sorted(QUANTS))
def test_threaded_chunks_equal_single_thread(type_name, monkeypatch):
    import llmctl.gguf.quants as q

    monkeypatch.setattr(q, "_CHUNK_ELEMENTS", 256)  # force many chunks
    x = np.random.default_rng(1).standard_normal((40, 128)).astype(np.float32)
    np.testing.assert_array_equal(quantize(x, type_name, threads=2),
                                  quantize(x, type_name, threads=1))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q5_1"])
def test_dequantized_error_is_within_one_step(type_name):
    x = np.random.default_rng(2).standard_normal((32, 64)).astype(np.float32)
    back = gguf.quants.dequantize(quantize(x, type_name), gguf.GGMLQuantizationType[type_name])
    blocks, recon = x.reshape(-1, 32), back.reshape(-1, 32)
    levels = {"Q8_0": 254, "Q4_0": 15, "Q5_1": 31}[type_name]
    step = (blocks.max(1) - blocks.min(1)) / levels  # a generous per-block step
    assert np.all(np.abs(recon - blocks).max(1) <= step + 1e-6)


def test_bytes_match_the_ggml_size_table():
    for name, quant in QUANTS.items():
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
        assert (quant.block_size, quant.type_size) == (block, size)
        assert quantize(np.ones((3, 64), np.float32), name).nbytes == quantized_nbytes((3, 64), name)


def test_rows_that_do_not_fit_the_block_are_refused_with_a_remedy():
    with pytest.raises(UsageError, match="multiple of 32"):
        quantize(np.ones((2, 48), np.float32), "Q4_0")
    with pytest.raises(UsageError, match="K-quants go through llama.cpp"):
        quantize(np.ones((2, 256), np.float32), "Q4_K")


def test_bf16_rounding_nan_and_inf_match_ggml():
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    x[0, :4] = [np.nan, -np.nan, np.inf, -np.inf]
    # the largest finite floats round up to inf; a NaN whose payload is in the low bits
    x[1, :3] = np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x7F800001], dtype=np.uint32).view(np.float32)
    x[2, :2] = np.array([0x3F808000, 0x3F818000], dtype=np.uint32).view(np.float32)  # exact ties
    reference = gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16)
    np.testing.assert_array_equal(quantize(x, "BF16"), reference)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 7e4 -> inf scales
@pytest.mark.parametrize("type_name", sorted(QUANTS))
@pytest.mark.parametrize("case", sorted(_cases()))
def test_decode_of_encoded_bytes_equals_gguf_py_dequantize(type_name, case):
    """Round trip: our encoder's bytes, read back by our decoder, are what gguf-py reads."""
    x = _cases()[case]
    quant = QUANTS[type_name]
    raw = quantize(x, type_name)
    blocks = raw.reshape(*raw.shape[:-1], -1, quant.type_size)
    ours = quant.dequantize(blocks).reshape(x.shape)
    reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, reference)


@pytest.mark.parametrize("type_name", sorted(n for n, q in QUANTS.items()
                                              if issubclass(q, LegacyBlock)))
def test_legacy_codes_stay_within_their_bits(type_name):
    """What the engine's low-bit kernel reads: ``bits``-bit codes, one scale per block."""
    quant = QUANTS[type_name]
    x = np.random.default_rng(4).standard_normal((6, 64)).astype(np.float32)
    q, d, z = quant.codes(quantize(x, type_name).reshape(6, 2, quant.type_size))
    assert q.shape == (6, 2, 32) and d.shape == (6, 2) and d.dtype == np.float32
    if q.dtype == np.int8:  # symmetric: no offset
        assert z is None and np.abs(q.astype(int)).max() <= 127
    else:
        assert q.dtype == np.uint8 and q.max() < 2 ** quant.bits and z.shape == (6, 2)
