"""MFU/MBU arithmetic, the engine meter, the verdict table and the dollar costs, on a
fake cost model whose numbers are easy to compute by hand."""

import pytest

from llmctl.perf import meter, money, utilization, verdicts
from llmctl.perf.peaks import Peaks
from llmctl.perf.utilization import PhaseLoad, Timed


class FakeCost:
    """100 FLOPs per token + 1 per context position; 10 KV bytes per token; the weights
    read per step 1000 bytes; prefill reads the weights once and writes/reads its KV."""

    kv_bytes_per_token = 10.0
    weight_bytes_read_per_step = 1000.0

    def flops_per_token(self, context):
        return 100.0 + context

    def sequence_kv_bytes(self, context):
        return self.kv_bytes_per_token * context

    def prefill_flops(self, prompt_len, cached=0):
        return sum(self.flops_per_token(p + 1) for p in range(cached, prompt_len))

    def prefill_bytes(self, prompt_len, cached=0):
        return self.weight_bytes_read_per_step + prompt_len * self.kv_bytes_per_token


PEAKS = Peaks({"bf16": 1000.0}, 100.0, "test peaks")


def test_mfu_and_mbu_are_achieved_rates_over_the_peaks():
    u = utilization.use("decode", PhaseLoad(flops=500.0, bytes=160.0, seconds=2.0), PEAKS,
                        "bf16")
    assert (u.flops_per_s, u.bytes_per_s) == (250.0, 80.0)
    assert (u.mfu, u.mbu) == (0.25, 0.8)
    unknown = utilization.use("decode", PhaseLoad(500.0, 160.0, 2.0), PEAKS, "fp32")
    assert unknown.mfu is None and unknown.mbu == 0.8  # no fp32 peak: said, not guessed
    idle = utilization.use("prefill", PhaseLoad(0.0, 0.0, 0.0), PEAKS, "bf16")
    assert idle.mfu is None and idle.mbu is None


def test_client_side_loads_split_the_phases_by_time_and_count_each_token():
    # two requests: prompt 3, 3 output tokens; prompt 2, 1 output token (no decode)
    reqs = [Timed(3, 3, start=0.0, ttft=1.0, latency=3.0, itl=[1.0, 1.0]),
            Timed(2, 1, start=0.5, ttft=1.0, latency=1.0)]
    loads = utilization.from_requests(reqs, FakeCost())
    # prefill: prompt 3 -> (101 + 102 + 103), prompt 2 -> (101 + 102); busy [0, 1.5]
    assert loads["prefill"].flops == 509.0
    assert loads["prefill"].bytes == 2000.0 + 50.0
    assert loads["prefill"].seconds == 1.5
    # decode: request 1's tokens 2 and 3 at contexts 4 and 5; busy [1, 3] = 2 s; median
    # gap 1 s -> 2 steps of 1000 weight bytes, plus KV 10 x (4 + 5)
    assert loads["decode"].flops == 104.0 + 105.0
    assert loads["decode"].bytes == 2000.0 + 90.0
    assert loads["decode"].seconds == 2.0


def test_engine_counter_deltas_give_per_phase_loads():
    deltas = {"prefill_flops": 21.0, "prefill_bytes": 11.0, "prefill_busy_seconds": 3.0,
              "decode_flops": 1.0, "decode_bytes": 2.0, "decode_busy_seconds": 0.5}
    loads = utilization.from_counters(deltas)
    assert loads["prefill"] == PhaseLoad(21.0, 11.0, 3.0)
    assert loads["decode"] == PhaseLoad(1.0, 2.0, 0.5)
    assert utilization.from_counters({**deltas, "decode_flops": None}) is None  # not exported
    assert set(utilization.counter_names()) == set(deltas)


def test_the_meter_counts_a_step_by_its_tokens_and_windows_recent_steps():
    cost = FakeCost()
    # a decode row at context 9 and a prefill chunk of 2 tokens after 3 cached
    load = meter.step_load(cost, 1000.0, [(9, 1), (3, 2)], seconds=0.5)
    assert load.flops == 110.0 + (104.0 + 105.0)
    assert load.bytes == 1000.0 + 10.0 * (10 + 5)
    now = [0.0]
    m = meter.StepMeter(window=10.0, clock=lambda: now[0])
    m.record("decode", PhaseLoad(1.0, 2.0, 0.1))
    now[0] = 5.0
    m.record("prefill", PhaseLoad(4.0, 4.0, 1.0))
    now[0] = 12.0  # the first step has left the window, not the totals
    assert m.recent()["decode"] == PhaseLoad(0.0, 0.0, 0.0)
    assert m.recent()["prefill"] == PhaseLoad(4.0, 4.0, 1.0)
    assert m.totals["decode"] == PhaseLoad(1.0, 2.0, 0.1)
    # many steps in and out of the window: the running sums equal a fresh sum of what
    # is in it, and a phase with no step left reads exactly zero (no float residue)
    for i in range(200):
        now[0] = 20.0 + i * 0.1
        m.record("decode" if i % 3 else "prefill", PhaseLoad(0.1 * i, 0.3, 0.07))
    recent = m.recent()
    inside = [(20.0 + i * 0.1, i) for i in range(200) if 20.0 + i * 0.1 >= now[0] - 10.0]
    assert recent["decode"].flops == pytest.approx(sum(0.1 * i for _, i in inside if i % 3))
    assert recent["prefill"].seconds == pytest.approx(0.07 * sum(1 for _, i in inside
                                                                   if not i % 3))
    now[0] = 1000.0
    assert m.recent() == {"prefill": PhaseLoad(0.0, 0.0, 0.0),
                          "decode": PhaseLoad(0.0, 0.0, 0.0)}


@pytest.mark.parametrize("mfu,mbu,bound", [
    (0.7, 0.2, "compute"), (0.1, 0.6, "bandwidth"), (0.3, 0.4, "overhead"),
    (None, 0.55, "bandwidth"), (None, None, None)])
def test_the_bound_is_the_roof_reached(mfu, mbu, bound):
    assert verdicts.bound_of(mfu, mbu) == bound


def _rules(s):
    return {a.rule: a for a in verdicts.advise(s)}


def test_every_rule_of_the_table_fires_on_its_situation_with_a_computed_gain():
    # bf16 decode at 60% MBU, weights 270 MB + KV 30 MB per step: 4-bit weights cut the
    # step to 270 * 4.125 / 16 + 30 = 99.6 MB (3.01x)
    s = verdicts.Situation("decode", "bandwidth", mfu=0.05, mbu=0.6, weight_bits=16,
                           weight_bytes_per_step=270e6, kv_bytes_per_step=30e6,
                           w4_weight_bytes_per_step=270e6 * 4.125 / 16)
    got = _rules(s)
    assert set(got) == {"decode-4bit-weights"}  # KV is 10% of the bytes: no KV advice
    assert got["decode-4bit-weights"].expected_gain == pytest.approx(300 / 99.609375, 1e-3)
    kv_heavy = verdicts.Situation("decode", "bandwidth", mbu=0.7, weight_bits=4.125,
                                  weight_bytes_per_step=70e6, kv_bytes_per_step=130e6)
    got = _rules(kv_heavy)
    assert set(got) == {"decode-8bit-kv"}  # already 4-bit: no weight advice
    assert got["decode-8bit-kv"].expected_gain == pytest.approx(200 / 135, 1e-3)
    got = _rules(verdicts.Situation("decode", "overhead", mfu=0.1, mbu=0.25))
    assert got["decode-overhead"].expected_gain == 2.0  # 0.5 / 0.25
    got = _rules(verdicts.Situation("decode", "compute", mfu=0.8, low_precision_speedup=2.0))
    assert got["decode-compute"].expected_gain == 2.0
    prefill = verdicts.Situation("prefill", "compute", mfu=0.7, shared_prefix_tokens=400,
                                 mean_prompt_tokens=500, prefix_hit_rate=0.0,
                                 ttft_p95_ms=900, ttft_slo_ms=500, roof_ttft_ms=300)
    got = _rules(prefill)
    assert set(got) == {"prefill-prefix-cache", "prefill-ttft-over-slo", "prefill-compute"}
    assert got["prefill-prefix-cache"].expected_gain == 5.0  # 500 / (500 - 400)
    assert got["prefill-ttft-over-slo"].expected_gain == 3.0  # 900 / 300
    assert got["prefill-compute"].expected_gain is None  # no lower-precision peak known
    hit = verdicts.Situation("prefill", "overhead", mfu=0.2, shared_prefix_tokens=400,
                             mean_prompt_tokens=500, prefix_hit_rate=0.78)
    assert set(_rules(hit)) == {"prefill-overhead"}
    # every rule of the table was exercised above
    assert {r.name for r in verdicts.RULES} == {
        "decode-4bit-weights", "decode-8bit-kv", "decode-overhead", "decode-compute",
        "prefill-prefix-cache", "prefill-ttft-over-slo", "prefill-overhead",
        "prefill-compute"}


def test_dollars_per_token_split_by_phase_time():
    c = money.cost_report(3.6, 100.0, input_tokens=50_000, output_tokens=10_000,
                          requests=40, prefill_share=0.25)
    assert c["run_usd"] == pytest.approx(0.1)
    assert c["usd_per_request"] == pytest.approx(0.0025)
    assert c["usd_per_1m_input_tokens"] == pytest.approx(0.025 / 50_000 * 1e6)
    assert c["usd_per_1m_output_tokens"] == pytest.approx(0.075 / 10_000 * 1e6)
    assert c["usd_per_1m_tokens"] == pytest.approx(0.1 / 60_000 * 1e6)
    blended = money.cost_report(3.6, 100.0, input_tokens=1, output_tokens=1, requests=1,
                                prefill_share=None)
    assert blended["usd_per_1m_output_tokens"] is None
    assert set(money.flat(blended)) == {"cost_usd_per_request", "cost_usd_per_1m_tokens"}
