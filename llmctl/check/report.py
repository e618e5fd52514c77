"""The report of ``llmctl check``: its JSON document, the Markdown written to be pasted as
a pull-request comment, and JUnit XML (``outputs`` writes them, with the HTML page).

report.json carries the run metadata block every llmctl report has, the verdict, every
candidate's lineage (what its artifact was made from, by hash), the steps with whether
each ran or reused a cached result, the metrics, the per-round speed values a later
run's noise-aware gates compare with, and the gate results.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmctl.check.runner import CandidateRun
from llmctl.gates import GateResult, junit_xml

SCHEMA = "llmctl.check/1"
EXIT_PASSED, EXIT_GATE_FAILED = 0, 1


def candidate_entry(run: CandidateRun, results: list[GateResult]) -> dict[str, Any]:
    numeric = {k: v for k, v in run.metrics.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {"name": run.name, "recipe": run.recipe, "path": run.path,
            "artifact": run.artifact_id, "lineage": run.lineage,
            "steps": [s.to_dict() for s in run.steps], "metrics": numeric,
            "counts": run.counts, "rounds": run.rounds, "reports": run.reports,
            "gates": [r.to_dict() for r in results],
            "passed": all(r.passed for r in results)}


def build(pipeline_dump: dict, runs: list[CandidateRun], results: dict[str, list[GateResult]],
          ranking: dict | None, *, require_all: bool, baseline: str | None,
          seconds: float) -> dict[str, Any]:
    from llmctl.report import run_metadata

    entries = [candidate_entry(r, results[r.name]) for r in runs]
    passed = [e["name"] for e in entries if e["passed"]]
    ok = len(passed) == len(entries) if require_all else bool(passed)
    failed = [{"candidate": e["name"], "gate": g["gate"]} for e in entries
              for g in e["gates"] if not g["passed"]]
    verdict = {"passed": ok, "exit_code": EXIT_PASSED if ok else EXIT_GATE_FAILED,
               "require_all": require_all, "passing": passed, "failed_gates": failed,
               "best": ranking["best"] if ranking else (passed[0] if passed else None)}
    return {"schema": SCHEMA, "verdict": verdict, "pipeline": pipeline_dump,
            "baseline": baseline, "candidates": entries, "ranking": ranking,
            "seconds": round(seconds, 2), "metadata": run_metadata(command="check")}


def _num(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def verdict_line(report: dict) -> str:
    v = report["verdict"]
    n = len(report["candidates"])
    if v["passed"]:
        head = "**PASS**"
        what = (f"{len(v['passing'])} of {n} candidates pass every gate"
                if n > 1 else "every gate passed")
        best = f"; best passing: `{v['best']}`" if n > 1 and v["best"] else ""
        return f"{head}: {what}{best}"
    failed = ", ".join(f"`{f['gate']}` ({f['candidate']})" for f in v["failed_gates"][:6])
    return f"**FAIL**: {len(v['failed_gates'])} gate(s) failed: {failed}"


def lineage_parts(lin: dict, *, versions: bool = True) -> list[str]:
    """A lineage document as short phrases, what was built first coming first (Markdown
    code spans mark names); the versions once, the last step's."""
    parts = lineage_parts(lin["candidate"], versions=False) if lin.get("candidate") else []
    if lin.get("model"):
        parts.append(f"model `{lin['model']['reference']}` sha256 "
                     f"{lin['model']['sha256'][:12]}")
    if lin.get("recipe"):
        parts.append(f"recipe `{lin['recipe']['reference']}`")
    if lin.get("calibration"):
        c = lin["calibration"]
        parts.append(f"calibration {c['samples']}x{c['seq_len']} ids sha256 "
                     f"{c['ids_sha256'][:12]}")
    if lin.get("kind") == "engine":
        parts.append(f"engine `{lin['target']}` {lin['precision'] or '(default precision)'} "
                     f"for {lin['host']['arch']}")
    if lin.get("endpoint"):
        parts.append(f"endpoint {lin['endpoint']}")
    if versions and lin.get("versions"):
        parts.append("versions " + ", ".join(f"{k} {v}" for k, v in lin["versions"].items()
                                             if v))
    return parts


def markdown(report: dict) -> str:
    lines = [f"## llmctl check: {verdict_line(report)}", ""]
    rows = [(e["name"], g) for e in report["candidates"] for g in e["gates"]]
    if rows:
        lines += ["| candidate | gate | value | compared (bound) | threshold | pass |",
                  "|---|---|---|---|---|---|"]
        for name, g in rows:
            lines.append(f"| {name} | `{g['gate']}` | {_num(g['value'])} | "
                         f"{_num(g['compared'])} | {_num(g['threshold'])} | "
                         f"{'yes' if g['passed'] else '**no**'} |")
        warnings = [g["warning"] for _, g in rows if g.get("warning")]
        lines += [""] + [f"> warning: {w}" for w in warnings] + ([""] if warnings else [])
    ranking = report.get("ranking")
    if ranking and len(report["candidates"]) > 1:
        lines += ["### Candidates", "",
                  (f"Ordered by {ranking['quality_metric'] or 'name'}; Pareto front over "
                   "quality, throughput and size marked *."), "",
                  "| candidate | quality | throughput | size (MB) | passes |", "|---|---|---|---|---|"]
        by_name = {e["name"]: e for e in report["candidates"]}
        for name in ranking["order"]:
            m = by_name[name]["metrics"]
            star = " *" if name in ranking["pareto"] else ""
            size = m.get(ranking["size_metric"]) if ranking["size_metric"] else None
            lines.append(f"| {name}{star} | {_num(m.get(ranking['quality_metric']))} | "
                         f"{_num(m.get(ranking['throughput_metric']))} | "
                         f"{_num(size / 1e6 if size else None)} | "
                         f"{'yes' if by_name[name]['passed'] else 'no'} |")
        lines.append("")
    lines += ["### Lineage", ""]
    for e in report["candidates"]:
        parts = [f"artifact `{e['artifact']}`"] if e["artifact"] else []
        parts += lineage_parts(e["lineage"])
        steps = ", ".join(f"{s['step']} {s['status']}" for s in e["steps"])
        lines.append(f"- **{e['name']}**: {'; '.join(parts)}. Steps: {steps or 'none'}.")
    meta = report["metadata"]
    lines += ["", (f"llmctl {meta['versions'].get('llmctl')}, commit "
                   f"{meta.get('llmctl_commit') or 'unknown'}, {meta['machine'].get('cpu')}, "
                   f"{report['seconds']:.0f} s.")]
    return "\n".join(lines) + "\n"


def junit(report: dict, results: dict[str, list[GateResult]]) -> str:
    suites = []
    for entry in report["candidates"]:
        xml = junit_xml(results[entry["name"]], suite=f"llmctl-check.{entry['name']}")
        suites.append("\n".join(xml.splitlines()[1:]))  # without the XML declaration
    return ('<?xml version="1.0" encoding="UTF-8"?>\n<testsuites name="llmctl-check">\n'
            + "\n".join(suites) + "\n</testsuites>\n")


def load_baseline(path: Path) -> dict:
    from llmctl.check.pipeline import PipelineError

    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError:
        raise PipelineError(f"cannot read baseline {path}", "check the path") from None
    except ValueError:
        raise PipelineError(f"baseline {path} is not JSON",
                            "pass the report.json of an earlier llmctl check") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise PipelineError(f"baseline {path} is not an llmctl check report",
                            f"pass the report.json of an earlier llmctl check ({SCHEMA})")
    return data
