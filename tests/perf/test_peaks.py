import pytest

from llmctl.perf.peaks import Peaks


def test_overrides_replace_the_value_and_say_so_in_the_source():
    base = Peaks({"bf16": 4.0e11, "fp32": 2.0e11}, 3.5e10, "probe: test cpu, 2 threads")
    new = base.with_overrides(flops=1.0e12, bandwidth=5.0e10)
    assert new.flops == {"bf16": 1.0e12, "fp32": 2.0e11}
    assert new.bandwidth == 5.0e10
    assert new.source.startswith("probe: test cpu, 2 threads; override: bf16 1e+12 FLOP/s")
    assert "override: 5e+10 B/s" in new.source
    assert base.with_overrides() is base
    assert Peaks.from_dict(new.to_dict()) == new


def test_an_unknown_dtype_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown peak dtype.*bf17.*known: fp32"):
        Peaks({"bf17": 1.0}, None, "x")
