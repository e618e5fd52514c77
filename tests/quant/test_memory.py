"""The memory estimate refuses runs that cannot fit, with a remedy."""

import pytest

from llmctl.errors import ResourceError
from llmctl.quant import memory
from llmctl.quant.calibration import CalibrationSpec
from llmctl.quant.pipeline import PipelineOptions
from llmctl.quant.run import memory_estimate, prepare


def test_estimate_grows_with_calibration_and_refuses_with_a_remedy(tiny_llama, monkeypatch):
    prep = prepare(str(tiny_llama), "w4a16-gptq")
    small = memory_estimate(prep, CalibrationSpec(samples=8, seq_len=64), PipelineOptions())
    big = memory_estimate(prep, CalibrationSpec(samples=800, seq_len=512), PipelineOptions())
    assert big.parts["calibration activations"] == 100 * 8 * small.parts["calibration activations"]
    assert big.parts["hessians"] > 0
    memory.check(small)  # fits
    big.available = 1 << 20
    with pytest.raises(ResourceError) as err:
        memory.check(big)
    assert "--samples" in err.value.remedy and "GiB" in err.value.message


def test_rtn_needs_no_hessians(tiny_llama):
    prep = prepare(str(tiny_llama), "w4a16-rtn")
    est = memory_estimate(prep, CalibrationSpec(samples=8, seq_len=64), PipelineOptions())
    assert est.parts["hessians"] == 0
