"""The ratio interval behind noise-aware speed gates, against hand-computed values."""

import math

import pytest

from llmctl.check.speed import ratio_interval, t975


def test_t_quantiles_match_the_table_and_approach_the_normal():
    assert t975(1) == 12.706 and t975(4) == 2.776 and t975(4.9) == 2.776  # floor: errs wide
    assert t975(30) == 2.042
    assert t975(40) == pytest.approx(2.0211, abs=2e-4)  # tables: 2.021
    assert t975(120) == pytest.approx(1.9799, abs=2e-4)  # tables: 1.980
    with pytest.raises(ValueError):
        t975(0.5)


def test_welch_interval_by_hand():
    cand, base = [100.0, 104.0, 98.0], [110.0, 108.0, 112.0]
    lc, lb = [math.log(v) for v in cand], [math.log(v) for v in base]
    mc, mb = sum(lc) / 3, sum(lb) / 3
    vc = sum((x - mc) ** 2 for x in lc) / 2
    vb = sum((x - mb) ** 2 for x in lb) / 2
    se = math.sqrt(vc / 3 + vb / 3)
    df = (vc / 3 + vb / 3) ** 2 / ((vc / 3) ** 2 / 2 + (vb / 3) ** 2 / 2)
    t = {2: 4.303, 3: 3.182, 4: 2.776}[math.floor(df)]
    iv = ratio_interval(cand, base)
    assert iv.ratio == pytest.approx(math.exp(mc - mb))
    assert iv.low == pytest.approx(math.exp(mc - mb - t * se))
    assert iv.high == pytest.approx(math.exp(mc - mb + t * se))
    assert iv.detectable == pytest.approx(1 - math.exp(-t * se))
    assert iv.df == pytest.approx(df)


def test_one_round_borrows_the_other_sides_noise_and_one_each_has_none():
    iv = ratio_interval([100.0], [90.0, 100.0, 110.0])
    assert iv.df == 2 and iv.low < iv.ratio < iv.high
    point = ratio_interval([100.0], [50.0])
    assert point.ratio == point.low == point.high == pytest.approx(2.0)  # exp(log 100 - log 50)
    assert point.detectable is None and point.df is None


def test_same_speed_passes_a_tolerance_a_halving_does_not():
    same = ratio_interval([200.0, 204.0, 198.0], [202.0, 199.0, 203.0])
    assert same.low > 0.95 and same.high < 1.05
    halved = ratio_interval([200.0, 204.0, 198.0], [404.0, 398.0, 406.0])
    assert halved.high < 0.95


@pytest.mark.parametrize("bad", [[0.0], [-1.0], [math.inf], [math.nan], []])
def test_rounds_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError):
        ratio_interval(bad, [1.0])
