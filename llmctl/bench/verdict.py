"""What a finished ``llmctl bench`` (or ``bench compare``) tells its caller: the summary
as data, the gate results, how to show them, and the exit code.

Exit codes: 0 every gate passed (or none given); 1 a gate failed, the target went
down during the run (its report is still written), or a capacity search found no level
meeting the SLO; 130 interrupted (the partial report is written). Gates are not judged on an interrupted or cut-short run: its numbers are
not the workload the gate was written for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from llmctl.bench.suite import SuiteResult

EXIT_OK = 0
EXIT_GATES_FAILED = 1
EXIT_TARGET_DOWN = 1
EXIT_NO_CAPACITY = 1
EXIT_INTERRUPTED = 130


@dataclass
class Verdict:
    data: dict
    gate_results: list = field(default_factory=list)
    exit_code: int = EXIT_OK
    error: str | None = None
    remedy: str | None = None


def render_gates(console, results) -> None:
    from rich.table import Table

    table = Table(title="Gates", title_justify="left")
    for name in ("gate", "value", "threshold", "result"):
        table.add_column(name, justify="left" if name == "gate" else "right")
    for r in results:
        verdict = "[green]pass[/green]" if r.passed else "[bold red]FAIL[/bold red]"
        table.add_row(r.gate.text, f"{r.compared:.4g}", f"{r.gate.op} {r.threshold:.4g}",
                      verdict)
    console.print(table)


def _gated(results: list, data: dict, junit: Path | None, suite: str) -> Verdict:
    if junit is not None:
        from llmctl.gates import junit_xml
        from llmctl.utils.atomic import write_text

        write_text(Path(junit), junit_xml(results, suite))
    if results:
        data["gates"] = [r.to_dict() for r in results]
    if all(r.passed for r in results):
        return Verdict(data, results)
    return Verdict(data, results, EXIT_GATES_FAILED, "performance gates failed (see the table)")


def run_verdict(result: SuiteResult, gates: list, junit: Path | None = None) -> Verdict:
    """Gates checked on every report (each sweep level), unless the run was cut short."""
    from llmctl.gates import evaluate_gates

    reports = [lv.report for lv in result.levels]
    data = {"reports": [str(lv.path) for lv in result.levels],
            "sweep": str(result.sweep_path) if result.sweep_path else None,
            "interrupted": result.interrupted, "target_down": result.target_down,
            "results": [{k: v for k, v in r.items()
                         if isinstance(v, (int, float, str)) or v is None} for r in reports]}
    if result.capacity is not None:
        data["capacity"] = result.capacity
    if result.interrupted:
        return Verdict(data, exit_code=EXIT_INTERRUPTED,
                       error="interrupted: the partial report above was written")
    if result.target_down:
        return Verdict(data, exit_code=EXIT_TARGET_DOWN,
                       error=f"the target went down during the run ({result.target_down})",
                       remedy="the report with the failed requests was written; check the "
                              "server")
    if result.capacity is not None and result.capacity["knee"] is None:
        return Verdict(data, exit_code=EXIT_NO_CAPACITY,
                       error=f"no load level met {', '.join(result.capacity['slo'])}",
                       remedy="lower --capacity-start, relax --slo, or look at the failed "
                              "levels in the report")
    if not gates:
        return Verdict(data)
    results = [r for report in reports for r in evaluate_gates(gates, report)]
    return _gated(results, data, junit, "llmctl-bench")


def compare_verdict(data: dict, gates: list, baseline: dict, candidate: dict) -> Verdict:
    """``bench compare --gate``: the last report against the first as the reference."""
    from llmctl.gates import evaluate_gates

    results = evaluate_gates(gates, candidate, reference=baseline) if gates else []
    return _gated(results, data, None, "llmctl-bench-compare")


def show_run(console, result: SuiteResult, verdict: Verdict) -> None:
    from llmctl.bench.report import render, render_capacity

    for lv in result.levels:
        render(console, lv.report)
        console.print(f"[dim]report: {lv.path}[/dim]")
    if result.capacity is not None:
        render_capacity(console, result.capacity)
    if result.sweep_path:
        console.print(f"[dim]sweep summary: {result.sweep_path}[/dim]")
    if verdict.gate_results:
        render_gates(console, verdict.gate_results)
