"""FP8 on the GPU's own tensor cores against llmctl's FP8 emulation.

No llmctl path calls an FP8 matmul yet: an FP8 checkpoint's weights are dequantized at
load on CUDA as on the CPU (llmctl.serve.layers.quant_linear.make_linear), and quantization
scores FP8 layers by quantize-dequantize (llmctl.quant.fp8.fake_quantize). What this
proves is that the emulation computes what the hardware computes: with llmctl's codes
and scales, ``torch._scaled_mm`` (cuBLASLt E4M3 x E4M3, float32 accumulation) equals the
float32 product of the dequantized operands within bf16 output rounding (2^-8 relative)
plus accumulation-order noise.
"""

from __future__ import annotations

import pytest
import torch

from llmctl.quant import fp8
from tests.gpu.common import GPU, REAL_CUDA, record

pytestmark = [*GPU, REAL_CUDA]


def _fp8_capable() -> bool:
    return not torch.cuda.is_available() or torch.cuda.get_device_capability(0) >= (8, 9)


NEEDS_FP8 = pytest.mark.skipif(not _fp8_capable(),
                               reason="FP8 tensor cores need compute capability 8.9+")


@NEEDS_FP8
def test_scaled_mm_equals_the_emulated_product():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=gen)  # activations, per-tensor dynamic scale
    w = torch.randn(256, 512, generator=gen) * 0.05  # weight [out, in], per-tensor scale
    sx = fp8.scale_for(x.abs().amax()).reshape(())
    sw = fp8.weight_scale(w, per_channel=False).reshape(())
    qx, qw = fp8.quantize(x, sx), fp8.quantize(w, sw)
    emulated = fp8.dequantize(qx, sx) @ fp8.dequantize(qw, sw).t()
    dev = torch.device("cuda")
    out = torch._scaled_mm(qx.to(dev), qw.to(dev).t(), scale_a=sx.float().to(dev),
                           scale_b=sw.float().to(dev), out_dtype=torch.bfloat16)
    got = out.float().cpu()
    rel = ((got - emulated).abs().max() / emulated.abs().max()).item()
    record("fp8_scaled_mm", max_rel=rel, capability=list(torch.cuda.get_device_capability(0)))
    torch.testing.assert_close(got, emulated, rtol=2 ** -7, atol=2e-3 * emulated.abs().max().item())


@NEEDS_FP8
def test_fp8_codes_are_the_same_on_both_devices():
    """E4M3 rounding (llmctl.quant.fp8.round_to_e4m3 / torch's cast) is bit-exact across
    devices: it is elementwise, no sums."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(128, 256, generator=gen)
    scale = fp8.weight_scale(w, per_channel=True)
    cpu = fp8.quantize(w, scale)
    cuda = fp8.quantize(w.cuda(), scale.cuda()).cpu()
    assert torch.equal(cpu.view(torch.uint8), cuda.view(torch.uint8))
