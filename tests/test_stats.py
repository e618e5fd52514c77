"""Confidence bounds against published values, closed forms and an independent solver."""

import math

import pytest

from llmctl.stats import (
    Z95,
    paired_difference_interval,
    paired_margin,
    tango_statistic,
    wilson_interval,
    wilson_margin,
)


def test_wilson_interval_textbook_value():
    # 8/10 at 95%: the textbook Wilson interval is (0.4902, 0.9433).
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)
    assert wilson_margin(0.8, 10, "low") == pytest.approx(0.8 - 0.4902, abs=1e-4)
    assert wilson_margin(0.8, 10, "high") == pytest.approx(0.9433 - 0.8, abs=1e-4)


@pytest.mark.parametrize("n", [10, 50, 200])
def test_wilson_zero_successes_closed_form(n):
    # p = 0: centre = half = (z²/2n) / (1 + z²/n), so the upper bound is z² / (n + z²).
    low, high = wilson_interval(0, n)
    assert low == pytest.approx(0.0, abs=1e-15)
    assert high == pytest.approx(Z95**2 / (n + Z95**2), rel=1e-12)


def test_tango_interval_matches_published_example():
    # Cavo et al. (2012) as tabulated by Fagerland, Lydersen & Laake, "Statistical Analysis
    # of Contingency Tables" (2017), ch. 8 (R package contingencytables' test suite):
    # n12 = 6, n21 = 16, N = 161 -> estimate -0.0621, Tango 95% CI (-0.1240, -0.0054).
    low, high = paired_difference_interval(gains=6, losses=16, n=161)
    assert (round(low, 4), round(high, 4)) == (-0.1240, -0.0054)


@pytest.mark.parametrize("n", [50, 200])
def test_no_discordant_items_closed_form(n):
    # b = c = 0: q = -Δ for Δ < 0, so T(Δ) = sqrt(n|Δ| / (1 - |Δ|)); T = z at |Δ| = z²/(n + z²).
    bound = Z95**2 / (n + Z95**2)
    low, high = paired_difference_interval(0, 0, n)
    assert low == pytest.approx(-bound, abs=1e-12) and high == pytest.approx(bound, abs=1e-12)
    assert paired_margin(0, n) == pytest.approx(bound, abs=1e-12)
    assert round(bound, 4) == {50: 0.0713, 200: 0.0188}[n]


def test_tango_statistic_at_zero_is_mcnemar():
    for b, c in [(3, 7), (11, 1), (5, 5)]:
        assert tango_statistic(b, c, 50, 0.0) == pytest.approx((b - c) / math.sqrt(b + c))


def test_everything_flipped_one_way():
    assert paired_difference_interval(0, 20, 20)[0] == -1.0
    assert paired_difference_interval(20, 0, 20)[1] == 1.0


def test_impossible_counts_are_rejected():
    with pytest.raises(ValueError):
        paired_difference_interval(30, 30, 50)


def _brute_force_lower(b: int, c: int, n: int, z: float = Z95) -> float:
    """Tango's lower bound from its definition, solved another way: the restricted MLE of
    the loss cell by golden-section search on the multinomial log-likelihood (instead of
    the quadratic's root), and the bound by a grid scan (instead of bisection)."""
    def loglik(q, delta):
        pb, pc, rest = q + delta, q, 1 - 2 * q - delta
        terms = [(b, pb), (c, pc), (n - b - c, rest)]
        if any(k > 0 and p <= 0 for k, p in terms):
            return -math.inf
        return sum(k * math.log(p) for k, p in terms if k > 0)

    def statistic(delta):
        lo, hi = max(0.0, -delta), (1 - delta) / 2
        g = (math.sqrt(5) - 1) / 2
        for _ in range(200):
            x1, x2 = hi - g * (hi - lo), lo + g * (hi - lo)
            if loglik(x1, delta) < loglik(x2, delta):
                lo = x1
            else:
                hi = x2
        q = (lo + hi) / 2
        var = n * (2 * q + delta * (1 - delta))
        return (b - c - n * delta) / math.sqrt(var) if var > 0 else math.inf

    estimate = (b - c) / n
    step, delta = 1e-3, estimate
    while delta - step > -1 and statistic(delta - step) <= z:
        delta -= step
    fine = 1e-6
    while delta - fine > -1 and statistic(delta - fine) <= z:
        delta -= fine
    return delta


@pytest.mark.parametrize("b,c,n", [(0, 5, 50), (2, 8, 50), (1, 11, 50), (0, 2, 200),
                                   (7, 3, 40)])
def test_tango_lower_bound_matches_an_independent_solver(b, c, n):
    assert paired_difference_interval(b, c, n)[0] == pytest.approx(
        _brute_force_lower(b, c, n), abs=2e-6)
