"""``llmctl plan``'s arithmetic: memory by hand, roofline bounds, SLOs, suggestions."""

import math

import pytest

from llmctl.errors import ConfigError
from llmctl.perf.arch import ArchSpec
from llmctl.perf.devices import device_peaks
from llmctl.perf.peaks import Peaks
from llmctl.perf.plan import (
    CPU_PROBED,
    DATASHEET,
    Efficiency,
    PlanOptions,
    activation_bytes,
    batch_sizes,
    make_plan,
    parse_slos,
)
from llmctl.perf.weight_format import NAMED
from tests.perf.test_costs import LLAMA3_8B, LLAMA3_70B

H100 = device_peaks("h100-80gb")
L8B, L70B = ArchSpec.from_config(LLAMA3_8B), ArchSpec.from_config(LLAMA3_70B)


def test_70b_bf16_does_not_fit_one_h100_and_suggests_tp_or_quantization():
    plan = make_plan(L70B, NAMED["bf16"], H100, PlanOptions())
    assert not plan.memory.fits and not plan.ok
    assert plan.memory.weight_bytes == pytest.approx(141.1e9, rel=0.001)
    assert plan.memory.kv_capacity_tokens == 0
    fixes = {s.flag: s for s in plan.suggestions if s.fixes}
    # 141 GB / 2 = 70.6 GB per GPU fits 0.9 x 80 GiB = 77.3 GB with ~5 GB of KV
    assert "--tp 2" in fixes and "70.6 GB per GPU" in fixes["--tp 2"].text
    # int4 g128: 68.45B linear weights x 4.125 bits + 16-bit table and head = 39.5 GB
    assert "--weights w4a16" in fixes
    assert "141.1 GB -> 39.5 GB per GPU" in fixes["--weights w4a16"].text
    # fp8 halves the weights to 72.7 GB: still no room for an 8192-token sequence
    fp8 = next(s for s in plan.suggestions if s.flag == "--weights fp8")
    assert not fp8.fits and "still does not fit" in fp8.text
    assert plan.suggestions[0].fixes  # fixes first
    # the KV dtype cannot help when the weights alone overflow: not suggested
    assert all("--kv-dtype" not in s.flag for s in plan.suggestions)


def test_8b_bf16_fits_with_the_kv_capacity_by_hand():
    plan = make_plan(L8B, NAMED["bf16"], H100, PlanOptions(context=8192))
    budget = 0.9 * 80 * 2**30  # gpu_memory_utilization x 80 GiB = 77,309,411,328 B
    weights = 16_060_522_496  # 8.03B parameters x 2 B
    # 8192 tokens x (2 x 4096 residual + 4096 q + 2 x 1024 kv + 3 x 14336 MLP) x 2 B
    # + 256 rows x 128256 float32 logits
    act = 8192 * (2 * 4096 + 4096 + 2048 + 3 * 14336) * 2 + 256 * 128256 * 4
    assert act == 1_070_858_240
    assert plan.memory.activation_bytes == act
    assert plan.memory.weight_bytes == weights
    assert plan.memory.kv_bytes_per_token == 131072  # 128 KiB
    tokens = math.floor((budget - weights - act) / 131072)
    assert plan.memory.kv_capacity_tokens == tokens == 459121
    assert plan.memory.max_concurrency == 459121 // 8192 == 56
    assert plan.ok and not plan.suggestions
    assert [r.batch for r in plan.decode] == [1, 2, 4, 8, 16, 32, 56]
    # batch 1 at 8192 tokens: 15.0 GB of matmul weights + 1 GiB of KV over 3.35 TB/s
    one = plan.decode[0].step
    assert one.bytes == pytest.approx(15_009_316_864 + 8192 * 131072)
    assert one.bound == "bandwidth"
    assert plan.decode[0].tpot_ms == pytest.approx(one.bytes / 3.35e12 * 1e3)


def test_tpot_bound_switches_from_bandwidth_to_compute_as_batch_grows():
    # ridge at 10 FLOP/byte: a bf16 weight gives 2 FLOPs per 2 bytes per sequence
    peaks = Peaks({"bf16": 1e12}, 1e11, "test", memory_bytes=10**12)
    plan = make_plan(L8B, NAMED["bf16"], peaks, PlanOptions(context=128))
    bounds = [r.step.bound for r in plan.decode]
    assert bounds[0] == "bandwidth" and bounds[-1] == "compute"
    first = bounds.index("compute")
    assert set(bounds[first:]) == {"compute"}  # stays compute-bound
    assert plan.decode[first - 1].batch < 10 < plan.decode[first].batch + 1
    for row in plan.decode:  # the datasheet estimate is the roofline itself
        assert row.step.seconds == row.step.roofline_s == max(row.step.compute_s,
                                                              row.step.memory_s)


def test_cpu_efficiency_adds_the_times_and_the_per_layer_cost():
    peaks = Peaks({"bf16": 4.4e11}, 3.5e10, "probe: test", memory_bytes=8 * 2**30)
    smol = ArchSpec.from_config({"model_type": "llama", "hidden_size": 576,
                                 "num_hidden_layers": 30, "num_attention_heads": 9,
                                 "num_key_value_heads": 3, "intermediate_size": 1536,
                                 "vocab_size": 49152, "tie_word_embeddings": True})
    plan = make_plan(smol, NAMED["bf16"], peaks, PlanOptions(context=96), CPU_PROBED)
    step = plan.decode[0].step
    assert step.overhead_s == pytest.approx(30 * 58e-6)
    assert step.seconds == pytest.approx(step.compute_s + step.memory_s + 30 * 58e-6)
    # SmolLM2-135M bf16 reads 269.0 MB per token: 7.69 ms at 35 GB/s; the results say
    # 100 tok/s (10.0 ms) at 35.1 GB/s: the estimate lands within 5%
    assert step.memory_s == pytest.approx(268_959_744 / 3.5e10 + 96 * 23040 / 3.5e10)
    assert plan.decode[0].tpot_ms == pytest.approx(10.0, rel=0.05)
    slower = Efficiency(bandwidth=0.5, basis="test")
    half = make_plan(smol, NAMED["bf16"], peaks, PlanOptions(context=96), slower)
    assert half.decode[0].step.memory_s == pytest.approx(2 * step.memory_s)


def test_prefill_is_chunked_and_logits_come_once():
    plan = make_plan(L8B, NAMED["bf16"], H100,
                     PlanOptions(context=16384, prompt_len=10000), DATASHEET)
    assert plan.prefill_chunks == 2  # 8192 + 1808 tokens
    assert plan.prefill.flops == pytest.approx(plan.cost.prefill_flops(10000))
    # each chunk reads the weights again; the prompt's K and V are written once and the
    # second chunk reads the first one's 8192 tokens of K and V
    assert plan.prefill.bytes == pytest.approx(2 * 15_009_316_864 + (10000 + 8192) * 131072,
                                               rel=1e-9)
    assert plan.prefill.bound == "compute"


def test_tensor_parallel_shards_weights_and_kv_heads():
    one = make_plan(L70B, NAMED["bf16"], H100, PlanOptions())
    two = make_plan(L70B, NAMED["bf16"], H100, PlanOptions(tp=2))
    assert two.memory.weight_bytes == one.memory.weight_bytes / 2
    assert two.memory.kv_bytes_per_token == 327680 / 2  # 4 of 8 KV heads per GPU
    # 16 GPUs: 64 q heads split, but 8 KV heads are replicated to one per GPU
    sixteen = make_plan(L70B, NAMED["bf16"], H100, PlanOptions(tp=16))
    assert sixteen.memory.kv_bytes_per_token == 327680 / 8
    assert "all-reduces" in " ".join(two.notes)
    with pytest.raises(ConfigError, match="tp 3 does not divide the 64 attention heads"):
        make_plan(L70B, NAMED["bf16"], H100, PlanOptions(tp=3))


def test_slos():
    slos = parse_slos("p95_ttft_ms<=500, p95_tpot_ms<=10,mean_itl_ms<100")
    assert [(s.stat, s.metric, s.op, s.limit_ms) for s in slos] == [
        ("p95", "ttft", "<=", 500.0), ("p95", "tpot", "<=", 10.0), ("mean", "tpot", "<", 100.0)]
    for bad in ("p95_ttft<=500", "p95_ttft_ms>=500", "ttft_ms<=1", "p95_tpot_ms<=fast"):
        with pytest.raises(ConfigError, match="cannot read SLO"):
            parse_slos(bad)
    plan = make_plan(L8B, NAMED["bf16"], H100, PlanOptions(slos=slos))
    # TPOT at 8192 tokens: 5.4 ms at batch 1, 6.0 at 2, ... 9.7 at 16, 14.8 at 32
    tpots = {r.batch: r.tpot_ms for r in plan.decode}
    assert tpots[16] <= 10 < tpots[32]
    assert plan.slo.met and plan.slo.max_batch == 16
    assert plan.slo.output_tokens_per_s == pytest.approx(16 / tpots[16] * 1e3)
    tight = make_plan(L8B, NAMED["bf16"], H100, PlanOptions(slos=parse_slos("p99_tpot_ms<=3")))
    assert not tight.slo.met and tight.slo.max_batch == 0 and not tight.ok
    flags = {s.flag: s for s in tight.suggestions}
    # 3 ms at 8192 tokens needs fewer bytes: w4a16 (4.1 GB of weights + 1 GiB of KV)
    assert flags["--weights w4a16"].fixes


def test_options_are_checked():
    for bad, match in (({"tp": 0}, "tp must be at least 1"),
                       ({"context": 0}, "context must be at least 1"),
                       ({"prompt_len": 9000}, "prompt_len must be in 1..context"),
                       ({"kv_dtype": "fp4"}, "unknown KV cache dtype"),
                       ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization")):
        with pytest.raises(ConfigError, match=match):
            PlanOptions(**bad)
    with pytest.raises(ConfigError, match="no memory bandwidth"):
        make_plan(L8B, NAMED["bf16"], Peaks({"bf16": 1.0}, None, "x", 1), PlanOptions())
    with pytest.raises(ConfigError, match="no fp8 FLOP/s peak"):
        make_plan(L8B, NAMED["fp8"], Peaks({"int8": 1.0}, 1.0, "x", 1), PlanOptions())


def test_fp8_weights_on_a_gpu_without_fp8_units_are_timed_in_bf16():
    plan = make_plan(L8B, NAMED["fp8"], device_peaks("a100-80gb"), PlanOptions())
    assert plan.compute_dtype == "bf16"
    assert any("no fp8 peak" in n for n in plan.notes)


def test_helpers():
    assert batch_sizes(0) == [1]
    assert batch_sizes(1) == [1]
    assert batch_sizes(8) == [1, 2, 4, 8]
    assert batch_sizes(56) == [1, 2, 4, 8, 16, 32, 56]
    # with tp the q/k/v and MLP parts split; the residual and the logits do not
    assert activation_bytes(L8B, 2, 8192, 256) == (
        8192 * (2 * 4096 + (4096 + 2048 + 3 * 14336) / 2) * 2 + 256 * 128256 * 4)
