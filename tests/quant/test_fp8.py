"""FP8 E4M3 rounding agrees bit for bit with an independent emulation (frexp/ldexp, no
FP8 dtype) and with torch's float8_e4m3fn."""

import torch

from llmctl.quant import fp8


def _probe_values() -> torch.Tensor:
    torch.manual_seed(0)
    random = torch.randn(200_000) * torch.logspace(-5, 2.6, 200_000)
    # every E4M3 magnitude, and the midpoints between neighbours (ties to even)
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[1:] + grid[:-1]) / 2
    edges = torch.tensor([0.0, -0.0, 448.0, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -6])
    values = torch.cat([random, grid, mids, edges])
    return torch.cat([values, -values])


def _emulated(x: torch.Tensor) -> torch.Tensor:
    """E4M3 rounding from its definition: a normal magnitude in [2^e, 2^(e+1)) is spaced
    2^(e-3) (3 mantissa bits), below 2^-6 the subnormals 2^-9; ties to even; saturate."""
    mag = x.abs().clamp(max=448.0)
    _, exp = torch.frexp(mag)  # mag = m * 2^exp, m in [0.5, 1)
    step = torch.ldexp(torch.ones_like(mag), torch.clamp(exp - 1, min=-6) - 3)
    return torch.copysign((torch.round(mag / step) * step).clamp(max=448.0), x)


def test_rounding_matches_the_definition_and_torch_float8():
    x = _probe_values()
    assert torch.equal(fp8.round_to_e4m3(x), _emulated(x))
    assert torch.equal(fp8.round_to_e4m3(x), x.to(torch.float8_e4m3fn).float())
    assert torch.equal(fp8.round_to_e4m3(x * 4), _emulated(x * 4))  # past 448: saturated


def test_rounding_saturates_at_448():
    x = torch.tensor([500.0, -1e6, 460.0])
    assert fp8.round_to_e4m3(x).tolist() == [448.0, -448.0, 448.0]


def test_quantize_per_channel_scales_and_dtype():
    torch.manual_seed(1)
    w = torch.randn(16, 32) * torch.logspace(-2, 2, 16).unsqueeze(1)
    scale = fp8.weight_scale(w, per_channel=True)
    assert scale.shape == (16, 1)
    q = fp8.quantize(w, scale)
    assert q.dtype == torch.float8_e4m3fn
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((16,), 448.0))
    rel = ((fp8.dequantize(q, scale) - w).abs() / w.abs().clamp(min=1e-3 * w.abs().max())).max()
    assert rel <= 2 ** -4 + 1e-6  # 3 mantissa bits: half a unit in the last place


def test_per_token_activations_use_one_scale_per_row():
    x = torch.tensor([[1.0, 0.001], [1000.0, 3.0]])
    y = fp8.fake_quantize_per_token(x)
    assert y[0, 0] == 1.0 and y[1, 0] == 1000.0  # each row's max maps onto 448 exactly
    assert abs(y[0, 1] - 0.001) < 1e-4
