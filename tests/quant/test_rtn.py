"""Round-to-nearest grids: ranges, granularity, exact reconstruction on the grid."""

import pytest
import torch

from llmctl.quant import rtn
from llmctl.quant.rtn import IntGrid


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [None, -1, 16])
def test_error_is_within_half_a_step(bits, symmetric, group_size):
    torch.manual_seed(0)
    w = torch.randn(24, 64)
    grid = IntGrid(bits, symmetric, group_size)
    q, scale, zero = rtn.rtn_quantize(w, grid)
    assert q.dtype == torch.int8
    assert int(q.min()) >= grid.qmin and int(q.max()) <= grid.qmax
    expected_shape = {None: (1,), -1: (24, 1), 16: (24, 4)}[group_size]
    assert tuple(scale.shape) == expected_shape
    assert (zero is None) == symmetric
    deq = rtn.dequantize(q, scale, zero, grid)
    # every element lies inside its group's range, so rounding costs at most half a step
    step = scale.reshape(-1, 1) if group_size is None else scale.repeat_interleave(
        64 if group_size == -1 else group_size, dim=1)
    assert torch.all((deq - w).abs() <= step / 2 + 1e-6)


def test_symmetric_scale_uses_the_full_grid():
    w = torch.tensor([[-3.0, 1.5, 0.0, 3.0]])
    scale, zero = rtn.minmax_params(w, IntGrid(4, True, -1))
    assert zero is None
    assert scale.item() == pytest.approx(3.0 / 7.5)  # 16 levels span [-amax, amax]
    q = rtn.quantize(w, scale, zero, IntGrid(4, True, -1))
    assert q.tolist() == [[-8, 4, 0, 7]]  # -7.5 rounds to even (-8), +7.5 clamps to 7


def test_asymmetric_grid_maps_min_to_lowest_code():
    w = torch.tensor([[0.5, 1.0, 2.0, 4.0]])
    grid = IntGrid(4, False, -1)
    scale, zero = rtn.minmax_params(w, grid)
    assert scale.item() == pytest.approx(4.0 / 15)  # zero is kept inside the range
    q = rtn.quantize(w, scale, zero, grid)
    assert int(q.min()) >= -8 and int(q.max()) == 7
    assert rtn.dequantize(torch.tensor([[-8]], dtype=torch.int8), scale, zero, grid).item() == \
        pytest.approx(0.0, abs=scale.item() / 2)


def test_values_on_the_grid_survive_exactly():
    torch.manual_seed(1)
    grid = IntGrid(4, True, 16)
    scale = torch.rand(8, 2) + 0.1
    q = torch.randint(-8, 8, (8, 32), dtype=torch.int8)
    w = rtn.dequantize(q, scale, None, grid)
    assert torch.equal(rtn.quantize(w, scale, None, grid), q)


def test_all_zero_group_quantizes_to_zero():
    grid = IntGrid(4, False, 8)
    w = torch.zeros(2, 16)
    q, scale, zero = rtn.rtn_quantize(w, grid)
    assert torch.all(rtn.dequantize(q, scale, zero, grid) == 0)
    assert torch.all(scale > 0)


def test_mse_observer_is_no_worse_than_minmax():
    torch.manual_seed(2)
    w = torch.randn(32, 128) ** 3  # heavy tails: clipping pays off
    grid = IntGrid(4, True, 32)
    err = {}
    for observer in ("minmax", "mse"):
        q, s, z = rtn.rtn_quantize(w, grid, observer)
        err[observer] = ((rtn.dequantize(q, s, z, grid) - w) ** 2).sum().item()
    assert err["mse"] < err["minmax"]


def test_unknown_observer_names_the_known_ones():
    with pytest.raises(ValueError, match="minmax"):
        rtn.observe(torch.ones(2, 2), IntGrid(4), "nope")


def test_per_token_activation_quantization_is_per_row():
    x = torch.tensor([[1.0, -2.0, 0.5], [100.0, 50.0, -25.0]])
    y = rtn.fake_quantize_per_token(x, 8)
    # each row keeps its own range: the small row is not crushed by the large one
    assert torch.allclose(y[0], x[0], atol=2.0 / 127.5)
    assert torch.allclose(y[1], x[1], atol=100.0 / 127.5)
