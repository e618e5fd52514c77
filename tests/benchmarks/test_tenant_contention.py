"""The tenant-contention load test's pure parts: refusal reasons, the auth file, verdicts."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from tenant_contention import auth_file_text, refusal_reason, tenant_summary, verdicts

from llmctl.bench.records import RequestRecord


def http(status: int, message: str, code: str | None) -> str:
    """What llmctl.bench.backends keeps of a refusal: the status and 300 body characters."""
    body = json.dumps({"error": {"message": message, "type": "x", "param": None,
                                 "code": code}})
    return f"HTTP {status}: {body[:300]}"


@pytest.mark.parametrize("error,reason", [
    (http(429, "the server is at its queue limit; retry later", "queue_full"),
     "429 queue full"),
    (http(429, "Rate limit reached for tenant 'A' on requests per min (RPM)",
          "rate_limit_exceeded"), "429 rate limit"),
    # a long message pushes the code past the 300 characters kept: the message decides
    (http(503, "the request cannot finish before its deadline: " + "x" * 300,
          "deadline_unmeetable"), "503 deadline"),
    (http(429, "Rate limit reached for tenant 'A': " + "y" * 300, "rate_limit_exceeded"),
     "429 rate limit"),
    (http(408, "the request did not finish within 60 s (--request-timeout)",
          "request_timeout"), "408 timeout"),
    (http(500, "boom", "internal_error"), "500 other"),
    ("cannot connect: refused", "other"),
    (None, None),
])
def test_refusal_reasons(error, reason):
    assert refusal_reason(error) == reason


def test_the_auth_file_holds_digests_classes_and_the_flooders_limit():
    keys = {"A": "sk-a", "A-batch": "sk-ab", "B": "sk-b"}
    data = json.loads(auth_file_text(keys, a_rpm=90))
    assert data["tenants"] == {"A": {"priority_class": "standard", "requests_per_minute": 90},
                               "A-batch": {"priority_class": "batch"},
                               "B": {"priority_class": "interactive"}}
    assert {e["tenant"]: e["key_sha256"] for e in data["keys"]} == \
        {name: hashlib.sha256(key.encode()).hexdigest() for name, key in keys.items()}
    assert "sk-a" not in auth_file_text(keys, a_rpm=None)


def record(ttft=None, error=None):
    rec = RequestRecord(0, 10, 10)
    rec.ttft, rec.error = ttft, error
    return rec


def test_tenant_summary_counts_and_percentiles():
    recs = [record(ttft=t / 1000) for t in (100, 200, 300, 400, 500)]
    recs.append(record(error=http(429, "Rate limit reached for x", "rate_limit_exceeded")))
    summary = tenant_summary(recs)
    assert (summary["sent"], summary["completed"]) == (6, 5)
    assert summary["refused"] == {"429 rate limit": 1}
    assert summary["p50_ttft_ms"] == pytest.approx(300)
    assert summary["p95_ttft_ms"] == pytest.approx(480)  # linear: 400 + 0.8 x 100


def round_(kind, b_p95, refused=None, probe_ttft=None):
    rec = {"kind": kind, "tenants": {"B": {"p95_ttft_ms": b_p95},
                                     "A": {"sent": 100, "refused": refused or {}}}}
    if probe_ttft is not None:
        rec["probe"] = {"ttft_s": probe_ttft, "e2e_s": probe_ttft + 2}
    return rec


def test_verdicts_take_medians_over_rounds_and_sum_refusals():
    rounds = [round_("baseline", 40), round_("contention", 90, {"429 rate limit": 7}, 12.0),
              round_("contention", 70, {"429 rate limit": 3, "503 deadline": 2}, 31.0),
              round_("baseline", 60), round_("contention", 200, {}, 5.0)]
    v = verdicts(rounds, aging_bound=30.0)
    assert v["b_p95_ttft_ms_baseline"] == 50 and v["b_p95_ttft_ms_contention"] == 90
    assert v["b_p95_ttft_ratio"] == pytest.approx(1.8) and v["b_within_target"] is True
    assert v["a_refused"] == {"429 rate limit": 10, "503 deadline": 2}
    assert v["a_sent"] == 300
    assert v["probe_worst_ttft_s"] == 31.0 and v["probes_within_bound"] is False
    assert verdicts([round_("baseline", 40)], 30.0)["b_within_target"] is None
