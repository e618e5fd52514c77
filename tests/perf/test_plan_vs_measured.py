"""``llmctl plan --hardware this`` against llmctl's own measured decode step on this kind
of machine: the committed results/plan-vs-measured-smollm2 holds the measurement (and the
probed peaks it was estimated with); this test re-derives every estimate from those peaks
with the current plan arithmetic, so a change to the cost model or the CPU efficiency
model that breaks the issue's 35% agreement fails here, not silently. (The measurement
itself is a benchmark: benchmarks/plan_vs_measured.py, never a timed unit test.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmctl.perf.arch import ArchSpec
from llmctl.perf.model_config import load_model_config
from llmctl.perf.peaks import Peaks
from llmctl.perf.plan import CPU_PROBED, PlanOptions, make_plan
from llmctl.perf.weight_format import WeightFormat

RESULT = Path(__file__).resolve().parents[2] / "results" / "plan-vs-measured-smollm2.json"
# the W4A16 checkpoint of the measurement: GPTQ int4, symmetric, group 64, lm_head at 16 bits
FORMATS = {"bf16": "bf16", "w4a16": "w4a16-g64"}


@pytest.fixture(scope="module")
def committed() -> dict:
    return json.loads(RESULT.read_text())


def test_the_committed_measurement_is_clean_and_covers_the_issues_cases(committed):
    assert not committed["dirty"] and not committed["contended"]
    assert set(committed["summary"]) == {f"{c} batch {b}" for c in FORMATS for b in (1, 16)}


@pytest.mark.parametrize("case", [f"{c} batch {b}" for c in FORMATS for b in (1, 16)])
def test_the_current_plan_stays_within_35_percent_of_the_measured_step(committed, case):
    row = committed["summary"][case]
    peaks = Peaks.from_dict(committed["model"]["peaks"])
    config, _ = load_model_config("smollm2-135m")
    weights = WeightFormat.from_name(FORMATS[row["case"]])
    plan = make_plan(ArchSpec.from_config(config), weights, peaks,
                     PlanOptions(context=committed["config"]["context"],
                                 prompt_len=committed["config"]["prompt_tokens"],
                                 max_num_seqs=row["batch"]), CPU_PROBED, suggest=False)
    estimate = next(r for r in plan.decode if r.batch == row["batch"]).to_dict()
    # the same weights and KV as the benchmark counted (the checkpoint's layout)
    assert estimate["bytes"] == pytest.approx(row["estimate"]["bytes"], rel=1e-6)
    ratio = estimate["tpot_ms"] / row["measured_tpot_ms"]
    assert 0.65 <= ratio <= 1.35, (case, estimate["tpot_ms"], row["measured_tpot_ms"])
