"""The gates of a pipeline, judged for one candidate.

Quality gates (and absolute speed gates) go through ``llmctl.gates.evaluate_gates``
exactly as ``llmctl eval --gate`` judges them: ``*reference`` is the eval reference's
value, ``delta(...)`` pairs the candidate's task items with the reference's, and
``*baseline`` is the value in the baseline report. A speed gate relative to the baseline
(``bench.W.METRIC OP F*baseline``) where both runs have rounds is judged on the strict
bound of the ratio's 95% interval across rounds (``llmctl.check.speed``): the lower
bound for ``>=``, the upper for ``<=``; it reports the smallest change those rounds can
detect and warns when that exceeds the gate's tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmctl.check.pipeline import Pipeline, PipelineError
from llmctl.check.runner import CandidateRun
from llmctl.check.speed import RatioInterval, ratio_interval
from llmctl.gates import OPERATORS, Gate, GateError, GateResult, evaluate_gates, gate_tolerance

SIZE_METRICS = ("size.checkpoint_bytes", "size.engine_bytes")


@dataclass(frozen=True)
class SpeedGateResult(GateResult):
    interval: RatioInterval | None = None

    def to_dict(self) -> dict:
        return {**super().to_dict(), "form": "ratio", "bound": "low" if self.gate.upward
                else "high", "interval": self.interval.to_dict() if self.interval else None}

    def describe(self) -> str:
        iv = self.interval
        side = "lower" if self.gate.upward else "upper"
        text = (f"{self.gate.metric} / baseline = {iv.ratio:.3f} over {iv.n_candidate} vs "
                f"{iv.n_baseline} rounds, 95% {side} bound {self.compared:.3f}; needs "
                f"{self.gate.op} {self.threshold:.3g}")
        if iv.detectable is not None:
            text += f"; detectable change {iv.detectable:.1%}"
        return text


def precheck(pipeline: Pipeline, baseline: dict | None) -> None:
    """Reject before any work the gates this pipeline can never judge (exit 2)."""
    workloads = {w.name for w in pipeline.bench}
    for gate in pipeline.parsed_gates():
        if gate.relative_to == "baseline" and baseline is None:
            raise PipelineError(f"gate {gate.text!r} compares with a baseline",
                                "pass --baseline REPORT.json (an earlier check's report.json)")
        if gate.metric.startswith("bench."):
            name = gate.metric.split(".")[1] if gate.metric.count(".") >= 2 else ""
            if name not in workloads:
                raise PipelineError(f"gate {gate.text!r}: no bench workload named {name!r}",
                                    "workloads: " + (", ".join(sorted(workloads)) or "none"))
        elif gate.metric.startswith("size."):
            sizes = SIZE_METRICS if pipeline.build is not None else SIZE_METRICS[:1]
            if gate.metric not in sizes:
                raise PipelineError(f"gate {gate.text!r}: unknown size metric",
                                    f"use {' or '.join(sizes)}" + (
                                        "" if pipeline.build is not None else
                                        " (size.engine_bytes needs a build: step)"))
        elif pipeline.eval is None:
            raise PipelineError(f"gate {gate.text!r} needs quality metrics",
                                "add an eval: step, or gate on bench.WORKLOAD.METRIC")
    if baseline is not None and any(g.relative_to == "baseline"
                                    for g in pipeline.parsed_gates()):
        q = pipeline.quantize
        for name in [c.name for c in q.candidates()] if q is not None else ["model"]:
            try:
                baseline_entry(baseline, name)
            except GateError as exc:
                raise PipelineError(f"--baseline: {exc.message}", exc.remedy) from None


def baseline_entry(baseline: dict | None, name: str) -> dict | None:
    """The baseline report's candidate of this name (or its only one)."""
    if baseline is None:
        return None
    entries = baseline.get("candidates") or []
    for entry in entries:
        if entry.get("name") == name:
            return entry
    if len(entries) == 1:
        return entries[0]
    raise GateError(f"the baseline has no candidate named {name!r}",
                    "its candidates: " + ", ".join(e.get("name", "?") for e in entries))


def _speed(gate: Gate, run: CandidateRun, base: dict) -> SpeedGateResult | None:
    ours, theirs = run.rounds.get(gate.metric), (base.get("rounds") or {}).get(gate.metric)
    if not ours or not theirs or gate.form != "value":
        return None
    interval = ratio_interval(ours, theirs)
    upward = gate.upward
    compared = interval.low if upward else interval.high
    tol = gate_tolerance(gate, 1.0, gate.threshold)  # an unchanged ratio is 1
    warning = None
    if interval.detectable is None:
        warning = (f"{gate.text}: one round on each side, no noise estimate: judged on the "
                   "ratio itself (use repeat: 3 or more)")
    elif 0 <= tol < interval.detectable:
        warning = (f"{gate.text}: these rounds can tell a change of {interval.detectable:.1%} "
                   f"from noise, more than the gate's tolerance {tol:.1%} (add rounds, "
                   "quiet the machine or widen the tolerance)")
    return SpeedGateResult(gate, interval.ratio, compared, gate.threshold,
                           OPERATORS[gate.op](compared, gate.threshold),
                           interval.n_candidate, interval.detectable, tol,
                           warning=warning, interval=interval)


def judge(gates: list[Gate], run: CandidateRun, base: dict | None) -> list[GateResult]:
    from llmctl.eval.paired import paired_counts

    results: dict[int, GateResult] = {}
    rest = []
    for i, gate in enumerate(gates):
        speed = None
        if gate.relative_to == "baseline" and gate.metric.startswith("bench.") and base:
            speed = _speed(gate, run, base)
        if speed is not None:
            results[i] = speed
        else:
            rest.append((i, gate))
    paired = None
    deltas = [g.metric for _, g in rest if g.form == "delta"]
    if deltas:
        report: dict[str, Any] = run.eval_report or {}
        paired = paired_counts(deltas, report.get("tasks") or {}, report.get("reference_tasks"),
                               "the reference run", "give eval: tasks (the reference runs them)")
    judged = evaluate_gates([g for _, g in rest], run.metrics, run.reference_metrics,
                            run.counts, paired, baseline=(base or {}).get("metrics"))
    for (i, _), result in zip(rest, judged, strict=True):
        results[i] = result
    return [results[i] for i in range(len(gates))]
