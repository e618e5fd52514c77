"""The weight bytes a batch-1 decode step reads (benchmarks/decode_bytes.py): matmul
weights whole, a lookup table one row, a tied embedding once as the lm_head matmul."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from decode_bytes import WeightRead, bytes_read_per_token, llmctl_model_reads


def test_lookup_reads_one_row_and_matmuls_read_everything():
    reads = [WeightRead("embed", 1000 * 8, rows=1000, lookup=True),
             WeightRead("layers", 500), WeightRead("lm_head", 1000 * 8)]
    assert bytes_read_per_token(reads) == 8 + 500 + 8000


def test_tied_table_is_not_counted_twice():
    """The resident count (table + packed lm_head copy) is one table more than is read."""
    table = 4096 * 64 * 2
    reads = [WeightRead("embed", table, rows=4096, lookup=True), WeightRead("layers", 10_000),
             WeightRead("lm_head", table)]
    resident = table + 10_000 + table
    assert resident - bytes_read_per_token(reads) == table - table // 4096


def test_smollm2_bf16_matches_its_parameter_count():
    """SmolLM2-135M: 134,515,008 parameters (tied, counted once); bf16 decode reads every
    parameter once (the table through the lm_head matmul) plus the looked-up row, 2 bytes
    each: 269.0 MB, where the resident tensors (table + packed lm_head copy) are 325.7 MB."""
    vocab, hidden, ffn, layers, kv = 49152, 576, 1536, 30, 3 * 64
    per_layer = [hidden * (hidden + 2 * kv), hidden * hidden, 2 * ffn * hidden, ffn * hidden,
                 hidden, hidden]  # qkv, o, gate_up, down, two norms
    reads = [WeightRead("embed", 2 * vocab * hidden, rows=vocab, lookup=True),
             WeightRead("norm", 2 * hidden), WeightRead("lm_head", 2 * vocab * hidden)]
    reads += [WeightRead(f"l{i}.{j}", 2 * n) for i in range(layers)
              for j, n in enumerate(per_layer)]
    params = 134_515_008
    assert bytes_read_per_token(reads) == 2 * (params + hidden)


def test_lookup_rows_must_divide_the_bytes():
    with pytest.raises(ValueError, match="rows"):
        bytes_read_per_token([WeightRead("embed", 10, rows=3, lookup=True)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llmctl_tied_model_reads(tmp_path, dtype):
    """On a real llmctl model (tied; in bf16 the lm_head is a packed copy of the table):
    bytes read = element size x (parameters + the one looked-up row)."""
    import torch

    from llmctl.serve.model.weights import load_model
    from tests.tiny import build_tiny_llama

    path = build_tiny_llama(tmp_path / "tiny", tie=True)
    hf = __import__("transformers").AutoModelForCausalLM.from_pretrained(str(path))
    params = sum(p.numel() for p in hf.parameters())  # tied weights appear once
    hidden = hf.config.hidden_size
    torch_dtype = getattr(torch, dtype)
    model = load_model(path, dtype=torch_dtype, device=torch.device("cpu"), backend="kernel",
                       max_len=64)
    size = torch.tensor([], dtype=torch_dtype).element_size()
    got = bytes_read_per_token(llmctl_model_reads(model))
    assert got == size * (params + hidden)
