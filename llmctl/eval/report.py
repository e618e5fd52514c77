"""Eval reports: JSON (the record) and a Markdown summary (for people and CI pages)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from llmctl.gates import GateResult
from llmctl.utils.atomic import write_text


def _f(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, int):
        return str(value)
    if abs(value) >= 1e4 or (0 < abs(value) < 1e-3):
        return f"{value:.{digits}g}" if abs(value) >= 1e4 else f"{value:.3e}"
    return f"{value:.{digits}f}"


def _pm(metrics: dict, key: str, scale: float = 1.0, digits: int = 4, unit: str = "") -> str:
    value, se = metrics.get(key), metrics.get(f"{key}_se")
    if value is None:
        return "–"
    text = f"{_f(value * scale, digits)}{unit}"
    return f"{text} ± {_f(se * scale, digits)}{unit}" if se is not None else text


GATE_NOTE = ("*compared*: the value, or the 95% bound a `wilson`/`delta` gate judges "
             "(`delta`: candidate minus reference on the same items, Tango's score bound). "
             "*detectable drop*: the smallest change the gate tells from no change at 95% "
             "confidence at this n (a rise, for `<=` gates).")


def attach_gates(report: dict[str, Any], results: list[GateResult], baseline: str | None,
                 baseline_metrics: dict[str, Any] | None = None) -> None:
    report["gates"] = [r.to_dict() for r in results]
    report["gates_passed"] = all(r.passed for r in results)
    report["baseline"] = baseline
    if baseline_metrics is not None:
        report["baseline_metrics"] = {k: v for k, v in baseline_metrics.items()
                                      if isinstance(v, (int, float))}


def markdown(report: dict[str, Any]) -> str:
    meta, m = report["metadata"], report["metrics"]
    cand = meta.get("candidate") or {}
    ref = meta.get("reference") or {}
    lines = [f"# llmctl eval: {cand.get('reference', '?')}", ""]
    lines.append(f"- candidate: `{cand.get('reference')}` ({cand.get('kind')}"
                 + (f", {cand['quantization']}" if cand.get("quantization") else "") + ")")
    if ref:
        lines.append(f"- reference: `{ref.get('reference')}`"
                     + (f" (top-{ref['top_k']} store)" if ref.get("top_k") else ""))
    data, windows = meta.get("data"), meta.get("windows")
    if data:
        lines.append(f"- data: `{data['spec']}` (sha256 {data['sha256'][:12]}, "
                     f"{data['tokens']} tokens)")
    if windows:
        lines.append(f"- windows: {windows['windows']} x ctx {windows['ctx']}, stride "
                     f"{windows.get('stride') or windows['ctx']}, BOS "
                     f"{'id ' + str(windows['bos_id']) if windows.get('bos_id') is not None else 'none'}"
                     f", {windows['scored_tokens']} tokens scored")
    machine = meta.get("machine", {})
    lines.append(f"- {meta.get('date')} · llmctl {meta.get('versions', {}).get('llmctl')} · "
                 f"commit {str(meta.get('llmctl_commit'))[:12]} · {machine.get('cpu')} "
                 f"({machine.get('cores')} cores, load {machine.get('load_average')})")
    lines.append("")
    if "ppl" in m:
        lines += ["## Perplexity", "", "| | value |", "| --- | --- |",
                  f"| PPL(candidate) | {_pm(m, 'ppl')} |"]
        if "ref_ppl" in m:
            lines += [f"| PPL(reference) | {_pm(m, 'ref_ppl')} |",
                      f"| PPL ratio | {_pm(m, 'ppl_ratio', digits=5)} |",
                      f"| ln(PPL ratio) | {_pm(m, 'ln_ppl_ratio', digits=5)} |",
                      f"| PPL difference | {_pm(m, 'ppl_diff')} |",
                      f"| correlation of ln PPL | {_f(m.get('ppl_corr', math.nan) * 100, 2)} % |"]
        lines += [f"| tokens scored | {m.get('tokens_scored')} |", ""]
    if "mean_kld" in m:
        lines += ["## KL divergence (candidate vs reference)", "",
                  "| statistic | KLD | Δp |", "| --- | --- | --- |",
                  f"| mean | {_pm(m, 'mean_kld', digits=6)} | {_pm(m, 'mean_dp', 100, 3, ' %')} |"]
        for key, label in (("max", "maximum"), ("p999", "99.9 %"), ("p99", "99 %"),
                           ("p95", "95 %"), ("p90", "90 %"), ("median", "median"),
                           ("p10", "10 %"), ("p1", "1 %"), ("min", "minimum")):
            dp = m.get(f"{key}_dp")
            lines.append(f"| {label} | {_f(m.get(f'{key}_kld'), 6)} | "
                         f"{_f(dp * 100, 3) + ' %' if dp is not None else '–'} |")
        lines += ["", f"- RMS Δp: {_pm(m, 'rms_dp', 100, 3, ' %')}",
                  f"- same top token: {_pm(m, 'same_top_p', 100, 3, ' %')}",
                  ("- KLD is over the reference's top-k tokens plus one lumped tail bucket "
                   "(a lower bound of the full-vocabulary KLD)."), ""]
    if report.get("tasks"):
        rm = report.get("reference_metrics") or report.get("baseline_metrics") or {}
        label = "reference acc" if report.get("reference_metrics") else "baseline acc"
        lines += ["## Tasks", "", f"| task | n | acc | acc_norm | {label} | source |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name, t in report["tasks"].items():
            lines.append(f"| {name} | {t['n']} | {_pm(m, f'task.{name}.acc', digits=3)} | "
                         f"{_pm(m, f'task.{name}.acc_norm', digits=3)} | "
                         f"{_f(rm.get(f'task.{name}.acc'), 3)} | {t['source']} |")
        lines.append("")
    if report.get("gates") is not None:
        verdict = "PASSED" if report.get("gates_passed") else "FAILED"
        lines += [f"## Gates: {verdict}", ""]
        if report.get("baseline"):
            lines += [f"`reference` values from `{report['baseline']}`", ""]
        lines += ["| gate | value | compared | threshold | n | detectable drop | result |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for g in report["gates"]:
            value = _f(g["value"])
            if g.get("form") == "delta":
                value += f" ({g['losses']} lost, {g['gains']} gained)"
            bound = f" ({g['bound']})" if g.get("bound") else ""
            lines.append(f"| `{g['gate']}` | {value} | {_f(g['compared'])}{bound} | "
                         f"{_f(g['threshold'])} | {_f(g.get('n'))} | "
                         f"{_f(g.get('detectable_drop'), 3)} | "
                         f"{'pass' if g['passed'] else '**FAIL**'} |")
        lines += ["", GATE_NOTE, ""]
        lines += [f"- warning: {g['warning']}" for g in report["gates"] if g.get("warning")]
        lines.append("")
    return "\n".join(lines)


def write_report(report: dict[str, Any], path: Path) -> tuple[Path, Path]:
    """Write ``path`` (JSON) and the Markdown summary next to it (``.md``)."""
    path = Path(path)
    write_text(path, json.dumps(report, indent=2, default=str) + "\n")
    md = path.with_suffix(".md")
    write_text(md, markdown(report) + "\n")
    return path, md


def load_report(path: Path) -> dict[str, Any]:
    from llmctl.errors import ConfigError

    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read eval report {path}: {exc}",
                          "pass a JSON file written by llmctl eval -o") from None
    if not isinstance(data, dict) or not isinstance(data.get("metrics"), dict):
        raise ConfigError(f"{path} is not an llmctl eval report (no 'metrics')",
                          "pass a JSON file written by llmctl eval -o")
    return data
