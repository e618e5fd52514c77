"""Pooling a prompt's hidden states chunk by chunk (llmctl.serve.core.pooling): the same
vector however the prompt is cut, recomputed rows (a preemption) counted once."""

import pytest
import torch

from llmctl.serve.core.pooling import PooledHidden

HIDDEN = torch.randn(10, 6, generator=torch.Generator().manual_seed(0))


def pooled(kind: str, chunks: list[tuple[int, int]], hidden: torch.Tensor = HIDDEN):
    p = PooledHidden(kind, hidden.shape[0])
    for start, end in chunks:
        rows = hidden[start:end] if kind == "mean" else hidden[end - 1:end]
        p.add(start if kind == "mean" else end - 1, rows)
    return p


@pytest.mark.parametrize("chunks", [[(0, 10)], [(0, 3), (3, 10)], [(0, 1), (1, 2), (2, 10)]])
def test_mean_is_the_mean_however_the_prompt_is_cut(chunks):
    p = pooled("mean", chunks)
    assert p.complete and p.every_position
    assert torch.allclose(torch.tensor(p.vector()), HIDDEN.mean(dim=0), atol=1e-6)


def test_mean_counts_recomputed_positions_once():
    # computed 0..6, preempted, recomputed from 0 in chunks of 4: positions 0..6 again
    p = pooled("mean", [(0, 3), (3, 6), (0, 4), (4, 8), (8, 10)])
    assert torch.allclose(torch.tensor(p.vector()), HIDDEN.mean(dim=0), atol=1e-6)


def test_mean_refuses_a_gap():
    p = PooledHidden("mean", 10)
    p.add(0, HIDDEN[:3])
    with pytest.raises(RuntimeError, match="from position 5"):
        p.add(5, HIDDEN[5:])


def test_last_takes_the_prompts_last_position_only():
    p = PooledHidden("last", 10)
    assert not p.every_position
    p.add(4, HIDDEN[4:5])  # not the end of the prompt: ignored
    assert not p.complete
    p.add(9, HIDDEN[9:10])
    assert p.complete and p.vector() == HIDDEN[9].tolist()


def test_half_precision_rows_pool_in_float32():
    half = HIDDEN.to(torch.bfloat16)
    p = pooled("mean", [(0, 5), (5, 10)], half)
    assert torch.allclose(torch.tensor(p.vector()), half.float().mean(dim=0), atol=1e-6)


def test_no_vector_before_complete_and_no_unknown_kind():
    p = PooledHidden("mean", 10)
    p.add(0, HIDDEN[:4])
    with pytest.raises(RuntimeError, match="not fully computed"):
        p.vector()
    with pytest.raises(ValueError, match="unknown pooling 'cls'"):
        PooledHidden("cls", 3)
