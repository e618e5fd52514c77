"""``llmctl eval compare A.json B.json [...]``: side by side, deltas and ratios vs the first."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# Shown first, in this order; other numeric metrics follow alphabetically with --all.
HEADLINE = ("ppl", "ref_ppl", "ppl_ratio", "ln_ppl_ratio", "mean_kld", "median_kld", "p90_kld",
            "p99_kld", "max_kld", "same_top_p", "mean_dp", "rms_dp", "tokens_scored")
_SKIP_SUFFIXES = ("_se", ".n")


def _label(path: str, report: dict[str, Any]) -> str:
    """The candidate's name as the user typed it; a path shortened to its last part."""
    cand = report.get("metadata", {}).get("candidate") or {}
    name = str(cand.get("reference") or Path(path).stem)
    return Path(name).name if "/" in name and not name.startswith(("openai:", "http")) else name


def comparable_problems(reports: list[dict[str, Any]]) -> list[str]:
    """Why numbers in these reports may not be comparable (different text or windows)."""
    problems = []
    first = reports[0].get("metadata", {})
    for i, report in enumerate(reports[1:], 2):
        meta = report.get("metadata", {})
        for key, what in (("data", "sha256"), ("windows", "ctx"), ("windows", "scored_tokens")):
            a, b = (first.get(key) or {}).get(what), (meta.get(key) or {}).get(what)
            if a != b:
                problems.append(f"report {i} differs from report 1 in {key}.{what} ({a} vs {b})")
        a, b = (first.get("reference") or {}).get("sha256_quick"), (
            meta.get("reference") or {}).get("sha256_quick")
        if a and b and a != b:
            problems.append(f"report {i} was measured against a different reference model")
    return problems


def compare_rows(reports: list[dict[str, Any]], all_metrics: bool = False) -> list[dict[str, Any]]:
    keys = [k for k in HEADLINE if any(k in r["metrics"] for r in reports)]
    task_keys = sorted({k for r in reports for k in r["metrics"]
                        if k.startswith("task.") and k.endswith((".acc", ".acc_norm"))})
    keys += task_keys
    if all_metrics:
        keys += sorted({k for r in reports for k, v in r["metrics"].items()
                        if isinstance(v, (int, float)) and k not in keys
                        and not k.endswith(_SKIP_SUFFIXES)})
    rows = []
    for key in keys:
        values = [r["metrics"].get(key) for r in reports]
        base = values[0]
        deltas, ratios = [], []
        for v in values[1:]:
            ok = isinstance(v, (int, float)) and isinstance(base, (int, float))
            deltas.append(v - base if ok else None)
            ratios.append(v / base if ok and base not in (0, None) and not math.isnan(base)
                          else None)
        errors = [r["metrics"].get(f"{key}_se") for r in reports]
        rows.append({"metric": key, "values": values, "errors": errors, "deltas": deltas,
                     "ratios": ratios})
    return rows


# Ranking: the first of these metrics every report has, lower is closer to the reference.
RANK_BY = ("mean_kld", "ln_ppl_ratio", "ppl")


def ranking(labels: list[str], reports: list[dict[str, Any]]) -> dict[str, Any] | None:
    for key in RANK_BY:
        values = [r["metrics"].get(key) for r in reports]
        if all(isinstance(v, (int, float)) for v in values):
            order = sorted(range(len(reports)), key=lambda i: values[i])
            return {"metric": key, "order": [labels[i] for i in order],
                    "values": [values[i] for i in order]}
    return None


def compare(paths: list[Path], all_metrics: bool = False) -> dict[str, Any]:
    from llmctl.eval.report import load_report

    reports = [load_report(p) for p in paths]
    labels = [_label(str(p), r) for p, r in zip(paths, reports)]
    return {"reports": [str(p) for p in paths], "labels": labels,
            "rows": compare_rows(reports, all_metrics), "ranking": ranking(labels, reports),
            "warnings": comparable_problems(reports)}


def _num(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, int):
        return str(v)
    return f"{v:.3e}" if v != 0 and abs(v) < 1e-3 else f"{v:.4f}"


def markdown(result: dict[str, Any]) -> str:
    labels = result["labels"]
    head = ["metric", *labels]
    for label in labels[1:]:
        head += [f"Δ {label}", f"ratio {label}"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in result["rows"]:
        cells = [row["metric"]]
        for v, e in zip(row["values"], row["errors"]):
            cells.append(_num(v) + (f" ± {_num(e)}" if e else ""))
        for d, r in zip(row["deltas"], row["ratios"]):
            cells += [("+" if d is not None and d > 0 else "") + _num(d), _num(r)]
        lines.append("| " + " | ".join(cells) + " |")
    rank = result.get("ranking")
    if rank:
        order = ", ".join(f"{label} ({_num(v)})" for label, v in zip(rank["order"], rank["values"]))
        lines.append(f"\nRanked by {rank['metric']} (closest to the reference first): {order}")
    for warning in result["warnings"]:
        lines.append(f"\nwarning: {warning}")
    return "\n".join(lines)
