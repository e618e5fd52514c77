"""Prometheus text parsing and before/after summaries (vLLM and llmctl names)."""

import pytest

from llmctl.bench.server_metrics import flat, parse_prometheus, summarize

BEFORE = """\
# HELP vllm:num_preemptions_total Cumulative number of preemptions.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{model_name="m"} 2.0
vllm:prefix_cache_queries_total{model_name="m"} 100.0
vllm:prefix_cache_hits_total{model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 40.0
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 20.0
vllm:kv_cache_usage_perc{model_name="m"} 0.0
vllm:request_success_total{finished_reason="stop",model_name="m"} 3.0
vllm:request_success_total{finished_reason="length",model_name="m"} 4.0
vllm:e2e_request_latency_seconds_bucket{le="0.3",model_name="m"} 1.0
vllm:gpu_cache_usage_perc{model_name="m"} NaN
"""
AFTER = BEFORE.replace(' 2.0', ' 5.0').replace('queries_total{model_name="m"} 100.0',
                                                'queries_total{model_name="m"} 300.0') \
    .replace('hits_total{model_name="m"} 10.0', 'hits_total{model_name="m"} 160.0') \
    .replace('draft_tokens_total{model_name="m"} 40.0', 'draft_tokens_total{model_name="m"} 80.0') \
    .replace('accepted_tokens_total{model_name="m"} 20.0',
             'accepted_tokens_total{model_name="m"} 50.0') \
    .replace('perc{model_name="m"} 0.0', 'perc{model_name="m"} 0.25')


def test_parse_sums_label_sets_and_skips_buckets_and_nan():
    values = parse_prometheus(BEFORE)
    assert values["vllm:request_success_total"] == 7.0
    assert not any(k.endswith("_bucket") for k in values)
    assert "vllm:gpu_cache_usage_perc" not in values


def test_summary_deltas_and_rates():
    mid = parse_prometheus(AFTER.replace('perc{model_name="m"} 0.25', 'perc{model_name="m"} 0.9'))
    s = summarize(parse_prometheus(BEFORE), parse_prometheus(AFTER), [mid])
    assert s["available"] and s["num_preemptions"] == 3.0
    assert s["prefix_cache_hit_rate"] == pytest.approx(150 / 200)
    assert s["spec_decode_acceptance_rate"] == pytest.approx(30 / 40)
    assert s["kv_cache_usage_after"] == 0.25 and s["kv_cache_usage_peak"] == 0.9
    assert flat(s)["server_num_preemptions"] == 3.0


def test_llmctl_prefix_is_read_too():
    text = 'llmctl:num_preemptions_total{model_name="m"} 1\nllmctl:kv_cache_usage_perc 0.5\n'
    s = summarize(parse_prometheus(text), parse_prometheus(text.replace(" 1\n", " 4\n")))
    assert s["num_preemptions"] == 3.0 and s["kv_cache_usage_peak"] == 0.5
    assert s["prefix_cache_hit_rate"] is None


def test_no_metrics_endpoint():
    assert summarize(None, None) == {"available": False}
    assert flat({"available": False}) == {}
