"""Quality and performance gates: ``metric OP threshold`` checks for CI.

Forms (``--gate`` strings, or a YAML list under ``gates:``); OP is <=, >=, <, > or ==::

    p99_ttft_ms<=500                      the measured value
    task.x.acc>=0.95*reference            relative to the reference run's value
    output_throughput>=0.95*baseline      relative to the baseline report's value (where a
                                          run has no reference of its own besides the
                                          baseline, ``eval``/``bench``, the two words mean
                                          the same run; ``llmctl check`` tells them apart)
    wilson_low(task.x.acc)>=0.60          the lower bound of a proportion's 95% Wilson interval
    wilson_high(task.x.acc)>=0.60         its upper bound (gives a drop the benefit of the doubt)
    wilson(task.x.acc)>=0.95*reference    the strict side: wilson_low for >= and >,
                                          wilson_high for <= and <
    delta(task.x.acc)>=-0.05              acc(candidate) - acc(reference) on the same items

A gate must not give a regression the benefit of the doubt: ``wilson(...)`` compares the
bound on the strict side, so a candidate passes only when the data show it clears the
threshold (earlier builds compared the lenient side: write ``wilson_high(...)>=`` for
that). ``delta(...)`` is paired: the candidate and the reference answered the same items,
so only items one got right and the other wrong count, and the gate compares the
strict bound of Tango's score interval of the difference (``llmctl.stats``) with the
threshold. That is far tighter than two unpaired intervals, and a candidate identical
to its reference has Δ = 0 with a bound of -z²/(n + z²) (-0.019 at n = 200).

Bounds are limits of two-sided 95% intervals (each a one-sided 97.5% bound). Every gate
on a proportion (a metric with a sample count) reports ``detectable_drop``: the smallest
change it can tell from no change at 95% confidence at this run's sample size, i.e. how
far the bound on the gate's side lies from an unchanged value (Wilson at the reference's
value, or at the measured one for an absolute threshold; for ``delta``, Tango's at
Δ = 0 with the run's discordant items split evenly between gains and losses).
When that is larger than the gate's tolerance (reference minus threshold; for ``delta``
minus the threshold) the result carries a warning: at this n the task set is too small
to gate on (a strict gate then fails even an unchanged candidate, a plain one passes or
fails on noise, a lenient one lets a drop larger than the tolerance through). A gate
whose threshold lies above the unchanged value asks for an improvement: no warning.

A malformed gate, or one on a metric the run does not produce, is a usage error (exit 2):
a misconfigured job, not a regression.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from llmctl.errors import ConfigError, UsageError
from llmctl.stats import (
    PairedCounts,
    paired_difference_interval,
    paired_margin,
    wilson_interval,
    wilson_margin,
)

OPERATORS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt,
             "==": operator.eq}
_UPWARD = (">=", ">")  # operators that fail on a drop

# form -> the side of the interval compared: "strict" is low for >=/>, high for <=/<.
FORMS: dict[str, str | None] = {"value": None, "wilson": "strict", "wilson_low": "low",
                                "wilson_high": "high", "delta": "strict"}
_NUMBER = r"[-+]?\d*\.?\d+(?:[eE][-+]?\d+)?"
_GATE = re.compile(
    r"^\s*(?:(?P<fn>wilson_low|wilson_high|wilson|delta)\(\s*(?P<fmetric>[\w.\-/]+)\s*\)"
    r"|(?P<metric>[\w.\-/]+))\s*"
    rf"(?P<op><=|>=|==|<|>)\s*(?:(?P<factor>{_NUMBER})\s*\*\s*)?"
    rf"(?P<value>reference|baseline|{_NUMBER})\s*$"
)
FORMS_HELP = ("write METRIC OP NUMBER with OP one of <= >= < > ==, e.g. 'p99_ttft_ms<=500', "
              "'task.x.acc>=0.95*reference', 'wilson_low(task.x.acc)>=0.6' (also "
              "wilson_high, and wilson = the strict side) or 'delta(task.x.acc)>=-0.05' "
              "(paired: candidate minus reference on the same items)")


class GateError(UsageError, ConfigError):
    """A gate that cannot be judged as written: malformed, or on a metric the run lacks."""


@dataclass(frozen=True)
class Gate:
    text: str
    metric: str
    op: str
    threshold: float  # absolute value, or the factor when ``relative``
    relative: bool = False
    form: str = "value"  # a key of FORMS
    relative_to: str | None = None  # "reference" or "baseline" when ``relative``

    @property
    def upward(self) -> bool:
        """True for >= and >: the gate fails on a drop (False: on a rise)."""
        return self.op in _UPWARD

    def side(self) -> str | None:
        """"low" or "high": which bound of the interval this gate compares (None: the value)."""
        side = FORMS[self.form]
        if side == "strict":
            return "low" if self.op in _UPWARD else "high"
        return side


@dataclass(frozen=True)
class GateResult:
    gate: Gate
    value: float  # the measured value (for delta: the observed difference)
    compared: float  # what was compared with the threshold: the value or a bound
    threshold: float
    passed: bool
    n: int | None = None  # items (or tokens) behind a proportion
    detectable: float | None = None  # smallest change the gate tells from noise
    tolerance: float | None = None  # how far below (above, for <=) no change the threshold is
    gains: int | None = None  # delta: items only the candidate got right
    losses: int | None = None  # delta: items only the reference got right
    warning: str | None = None

    def to_dict(self) -> dict:
        return {"gate": self.gate.text, "metric": self.gate.metric, "form": self.gate.form,
                "bound": self.gate.side(), "value": self.value, "compared": self.compared,
                "threshold": self.threshold, "passed": self.passed, "n": self.n,
                "detectable_drop": self.detectable, "tolerance": self.tolerance,
                "gains": self.gains, "losses": self.losses, "warning": self.warning}

    def describe(self) -> str:
        """One line: what was compared, with what, and how fine the gate can see."""
        g = self.gate
        if g.form == "delta":
            what = (f"Δ = {self.value:+.3f} ({self.losses} lost, {self.gains} gained of "
                    f"{self.n} items), {_BOUND_NAMES[g.side()]} bound {self.compared:+.3f}")
        elif g.side() is not None:
            what = (f"{g.metric} = {self.value:.4g} (n={self.n}), Wilson "
                    f"{_BOUND_NAMES[g.side()]} bound {self.compared:.4g}")
        else:
            what = f"{g.metric} = {self.value:.6g}"
        text = f"{what}; needs {g.op} {self.threshold:.6g}"
        if self.detectable is not None:
            text += f"; detectable {'drop' if g.op in _UPWARD else 'rise'} {self.detectable:.3g}"
        return text


_BOUND_NAMES = {"low": "lower", "high": "upper"}


def parse_gate(text: str) -> Gate:
    match = _GATE.match(text)
    if not match:
        raise GateError(f"cannot parse gate {text!r}", FORMS_HELP)
    form = match["fn"] or "value"
    metric = match["metric"] or match["fmetric"]
    relative = match["value"] in ("reference", "baseline")
    if form != "value" and match["op"] == "==":
        raise GateError(f"gate {text!r}: a bound cannot be compared with ==",
                        "use >= or > (the lower bound) or <= or < (the upper bound)")
    if form == "delta" and (relative or match["factor"]):
        raise GateError(f"gate {text!r}: delta(...) is already a difference from the reference",
                        "give the allowed change in accuracy, e.g. delta(task.x.acc)>=-0.05")
    if relative:
        threshold = float(match["factor"]) if match["factor"] else 1.0
    elif match["factor"]:
        threshold = float(match["factor"]) * float(match["value"])
    else:
        threshold = float(match["value"])
    return Gate(text.strip(), metric, match["op"], threshold, relative, form,
                match["value"] if relative else None)


def load_gates(texts: list[str] | None = None, file: Path | None = None) -> list[Gate]:
    """Gates from the command line plus an optional YAML file (``gates: [...]``)."""
    gates = [parse_gate(t) for t in texts or []]
    if file is not None:
        from llmctl.utils.yaml_file import read_yaml

        path = Path(file)
        _, data = read_yaml(path, GateError, what="gate file")
        entries = data.get("gates") if isinstance(data, dict) else data
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            raise GateError(f"{path} must hold a list of gate strings under 'gates:'",
                            "e.g. gates: ['ppl_ratio<=1.05', 'delta(task.x.acc)>=-0.05']")
        gates.extend(parse_gate(e) for e in entries)
    return gates


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float))


def _known(metrics: Mapping[str, object]) -> str:
    names = sorted(k for k, v in metrics.items() if _is_number(v))
    listed = ", ".join(names[:40]) + (f", ... ({len(names)} in all)" if len(names) > 40 else "")
    return f"metrics of this run: {listed or 'none'}"


def gate_tolerance(gate: Gate, unchanged: float, threshold: float) -> float:
    """How far the threshold lies on the failing side of an unchanged value."""
    return unchanged - threshold if gate.op in _UPWARD else threshold - unchanged


def _warning(gate: Gate, n: int, detectable: float, tolerance: float | None) -> str | None:
    if tolerance is None or tolerance < 0 or detectable <= tolerance:
        return None  # tolerance < 0: the gate asks for an improvement, by design
    change = "drop" if gate.op in _UPWARD else "rise"
    return (f"{gate.text}: at n={n} the smallest {change} this gate can tell from noise is "
            f"{detectable:.3f}, more than its tolerance {tolerance:.3f}: the task set is too "
            "small to gate on at this tolerance (use more items or a wider tolerance)")


def _judge_delta(gate: Gate, paired: Mapping[str, PairedCounts] | None) -> GateResult:
    counts = (paired or {}).get(gate.metric)
    if counts is None:
        raise GateError(
            f"gate {gate.text!r} needs per-item results of the candidate and the reference",
            "delta(...) applies to task accuracies (task.NAME.acc, task.NAME.acc_norm) of "
            "llmctl eval with --reference MODEL or a --baseline report written by this version"
            + (f"; paired metrics here: {', '.join(sorted(paired))}" if paired else ""))
    n = counts.n
    low, high = paired_difference_interval(counts.gains, counts.losses, n)
    compared = low if gate.side() == "low" else high
    detectable = paired_margin(counts.discordant, n)
    tolerance = gate_tolerance(gate, 0.0, gate.threshold)
    return GateResult(gate, counts.difference, compared, gate.threshold,
                      OPERATORS[gate.op](compared, gate.threshold), n, detectable, tolerance,
                      counts.gains, counts.losses, _warning(gate, n, detectable, tolerance))


def evaluate_gates(gates: list[Gate], metrics: Mapping[str, object],
                   reference: Mapping[str, object] | None = None,
                   counts: Mapping[str, int] | None = None,
                   paired: Mapping[str, PairedCounts] | None = None,
                   baseline: Mapping[str, object] | None = None) -> list[GateResult]:
    """Check every gate.

    ``counts``: the number of items behind each proportion (for Wilson bounds and the
    detectable drop); ``paired``: per-metric agreement of candidate and reference on the
    same items (for ``delta``). A gate on a metric the run lacks raises GateError (exit 2);
    a metric the run has but could not measure (``None``) raises ConfigError (exit 1).
    ``baseline``: the values ``*baseline`` gates compare with (default: ``reference``).
    """
    results = []
    for gate in gates:
        if gate.form == "delta":
            results.append(_judge_delta(gate, paired))
            continue
        if gate.metric not in metrics or not (metrics[gate.metric] is None
                                               or _is_number(metrics[gate.metric])):
            raise GateError(f"gate {gate.text!r}: no numeric metric {gate.metric!r} in this run",
                            _known(metrics))
        if metrics[gate.metric] is None:
            raise ConfigError(f"gate {gate.text!r}: {gate.metric} was not measured in this run",
                              "check the run's report (e.g. did any request complete?)")
        value = float(metrics[gate.metric])
        threshold, unchanged = gate.threshold, None
        if gate.relative:
            source = baseline if gate.relative_to == "baseline" and baseline is not None \
                else reference
            ref = (source or {}).get(gate.metric)
            if not _is_number(ref):
                raise GateError(f"gate {gate.text!r} compares with the {gate.relative_to}'s "
                                f"{gate.metric}, which the {gate.relative_to} does not have",
                                "run with a reference (--reference / --baseline) that has it")
            unchanged = float(ref)
            threshold = gate.threshold * unchanged
        n = (counts or {}).get(gate.metric)
        side = gate.side()
        if side is not None and not n:
            raise GateError(f"gate {gate.text!r} needs the sample count of {gate.metric}",
                            "Wilson bounds apply to proportions measured on N items, e.g. "
                            "task.NAME.acc")
        compared = value
        if side is not None:
            low, high = wilson_interval(value * n, n)
            compared = low if side == "low" else high
        detectable = tolerance = warning = None
        if n:  # a proportion: say how fine the gate can see at this n
            point = value if unchanged is None else unchanged
            detectable = wilson_margin(point, n, "low" if gate.op in _UPWARD else "high")
            if unchanged is not None:
                tolerance = gate_tolerance(gate, unchanged, threshold)
            warning = _warning(gate, n, detectable, tolerance)
        results.append(GateResult(gate, value, compared, threshold,
                                  OPERATORS[gate.op](compared, threshold), n, detectable,
                                  tolerance, warning=warning))
    return results


def junit_xml(results: list[GateResult], suite: str = "llmctl-gates") -> str:
    """JUnit XML that CI systems (GitHub, GitLab, Jenkins) show as test results."""
    failures = sum(not r.passed for r in results)
    lines = ['<?xml version="1.0" encoding="UTF-8"?>',
             (f"<testsuite name={quoteattr(suite)} tests=\"{len(results)}\" "
              f"failures=\"{failures}\" errors=\"0\">")]
    for r in results:
        lines.append(f"  <testcase classname={quoteattr(suite)} name={quoteattr(r.gate.text)}>")
        detail = r.describe() + (f"\nwarning: {r.warning}" if r.warning else "")
        if not r.passed:
            message = f"{r.gate.text} failed: {r.describe()}"
            lines.append(f"    <failure message={quoteattr(message)}>{escape(detail)}</failure>")
        lines.append(f"    <system-out>{escape(detail)}</system-out>")
        lines.append("  </testcase>")
    lines.append("</testsuite>")
    return "\n".join(lines) + "\n"
