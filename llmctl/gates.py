"""Quality and performance gates: ``metric OP threshold`` checks for CI.

Syntax (``--gate`` strings, or a YAML list under ``gates:``)::

    p99_ttft_ms<=500
    ppl_ratio<=1.05
    task.hellaswag.acc>=0.95*reference     # relative to the reference run's value
    wilson(task.arc.acc)>=0.40             # a 95% Wilson bound instead of the estimate

A Wilson gate judges a proportion by the bound on the side that favours passing
(the upper bound for ``>=``, the lower for ``<=``): it fails only when the data are
convincing, so noise on a small task set does not flap CI.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from llmctl.errors import ConfigError

OPERATORS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt,
             "==": operator.eq}
_GATE = re.compile(
    r"^\s*(?:(?P<fn>wilson)\((?P<fmetric>[\w.\-/]+)\)|(?P<metric>[\w.\-/]+))\s*"
    r"(?P<op><=|>=|==|<|>)\s*"
    r"(?:(?P<factor>[-+]?\d*\.?\d+(?:[eE][-+]?\d+)?)\s*\*\s*)?(?P<value>reference|"
    r"[-+]?\d*\.?\d+(?:[eE][-+]?\d+)?)\s*$"
)
_Z95 = 1.959963984540054


@dataclass(frozen=True)
class Gate:
    text: str
    metric: str
    op: str
    threshold: float  # absolute value, or the factor when ``relative``
    relative: bool = False
    wilson: bool = False


@dataclass(frozen=True)
class GateResult:
    gate: Gate
    value: float
    compared: float  # the value actually compared (a Wilson bound, or the value)
    threshold: float
    passed: bool

    def to_dict(self) -> dict:
        return {"gate": self.gate.text, "metric": self.gate.metric, "value": self.value,
                "compared": self.compared, "threshold": self.threshold, "passed": self.passed}


def parse_gate(text: str) -> Gate:
    match = _GATE.match(text)
    if not match:
        raise ConfigError(
            f"cannot parse gate {text!r}",
            "write METRIC OP NUMBER, e.g. 'p99_ttft_ms<=500', 'ppl_ratio<=1.05', "
            "'task.x.acc>=0.95*reference' or 'wilson(task.x.acc)>=0.4'",
        )
    metric = match["metric"] or match["fmetric"]
    relative = match["value"] == "reference"
    if relative:
        threshold = float(match["factor"]) if match["factor"] else 1.0
    elif match["factor"]:
        threshold = float(match["factor"]) * float(match["value"])
    else:
        threshold = float(match["value"])
    return Gate(text.strip(), metric, match["op"], threshold, relative, bool(match["fn"]))


def load_gates(texts: list[str] | None = None, file: Path | None = None) -> list[Gate]:
    """Gates from the command line plus an optional YAML file (``gates: [...]``)."""
    gates = [parse_gate(t) for t in texts or []]
    if file is not None:
        import yaml

        path = Path(file)
        if not path.is_file():
            raise ConfigError(f"no gate file at {path}", "check the path")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}", "fix the file") from None
        entries = data.get("gates") if isinstance(data, dict) else data
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            raise ConfigError(f"{path} must hold a list of gate strings under 'gates:'",
                              "e.g. gates: ['ppl_ratio<=1.05', 'mean_kld<=0.05']")
        gates.extend(parse_gate(e) for e in entries)
    return gates


def wilson_interval(successes: float, n: int, z: float = _Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson 1927)."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def evaluate_gates(gates: list[Gate], metrics: Mapping[str, float],
                   reference: Mapping[str, float] | None = None,
                   counts: Mapping[str, int] | None = None) -> list[GateResult]:
    """Check every gate; a missing metric is a configuration error, not a failure."""
    results = []
    for gate in gates:
        if gate.metric not in metrics or metrics[gate.metric] is None:
            known = ", ".join(sorted(k for k, v in metrics.items()
                                     if isinstance(v, (int, float)))[:40])
            raise ConfigError(f"gate {gate.text!r}: no metric {gate.metric!r} in this run",
                              f"available metrics: {known}")
        value = float(metrics[gate.metric])
        threshold = gate.threshold
        if gate.relative:
            if reference is None or gate.metric not in reference:
                raise ConfigError(f"gate {gate.text!r} compares with a reference value",
                                  "run with a reference (e.g. --reference) that has this metric")
            threshold = gate.threshold * float(reference[gate.metric])
        compared = value
        if gate.wilson:
            n = (counts or {}).get(gate.metric)
            if not n:
                raise ConfigError(f"gate {gate.text!r} needs the sample count of {gate.metric}",
                                  "Wilson bounds apply to proportions measured on N items")
            low, high = wilson_interval(value * n, n)
            compared = high if gate.op in (">=", ">") else low
        passed = OPERATORS[gate.op](compared, threshold)
        results.append(GateResult(gate, value, compared, threshold, passed))
    return results


def junit_xml(results: list[GateResult], suite: str = "llmctl-gates") -> str:
    """JUnit XML that CI systems (GitHub, GitLab, Jenkins) show as test results."""
    failures = sum(not r.passed for r in results)
    lines = ['<?xml version="1.0" encoding="UTF-8"?>',
             f"<testsuite name={quoteattr(suite)} tests=\"{len(results)}\" "
             f"failures=\"{failures}\" errors=\"0\">"]
    for r in results:
        lines.append(f"  <testcase classname={quoteattr(suite)} name={quoteattr(r.gate.text)}>")
        if not r.passed:
            message = (f"{r.gate.metric} = {r.compared:.6g} does not satisfy "
                       f"{r.gate.op} {r.threshold:.6g}")
            lines.append(f"    <failure message={quoteattr(message)}>{escape(message)}</failure>")
        lines.append("  </testcase>")
    lines.append("</testsuite>")
    return "\n".join(lines) + "\n"
