"""Figures of a check report (matplotlib, the optional ``plots`` extra): the candidates'
quality against throughput with the Pareto front, and each workload's throughput against
its p99 latencies."""

from __future__ import annotations

from pathlib import Path

from llmctl.bench.plots import pyplot, save_png


def _candidates(report: dict) -> list[dict]:
    return report.get("candidates") or []


def pareto(report: dict, path: Path) -> Path | None:
    """Quality (x, lower is better) against throughput (y), passing candidates filled,
    the Pareto front joined; None when the run has no quality or no speed axis."""
    ranking = report.get("ranking") or {}
    qk, tk = ranking.get("quality_metric"), ranking.get("throughput_metric")
    if not qk or not tk:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    front = []
    for entry in _candidates(report):
        x, y = entry["metrics"][qk], entry["metrics"][tk]
        passed = entry["passed"]
        ax.scatter([x], [y], s=60, marker="o", facecolors="C0" if passed else "none",
                   edgecolors="C0")
        ax.annotate(entry["name"], (x, y), textcoords="offset points", xytext=(6, 4),
                    fontsize=8)
        if entry["name"] in ranking.get("pareto", []):
            front.append((x, y))
    if len(front) > 1:
        xs, ys = zip(*sorted(front), strict=True)
        ax.plot(xs, ys, linestyle="--", color="C1", linewidth=1, label="Pareto front")
        ax.legend(loc="best", fontsize=8)
    ax.set_xlabel(f"{qk} (lower is better)")
    ax.set_ylabel(f"{tk} (tok/s)")
    ax.set_title("Candidates: filled = passes every gate", fontsize=10)
    ax.grid(alpha=0.3)
    try:
        return save_png(fig, path)
    finally:
        plt.close(fig)


TRADEOFF = (("p99_ttft_ms", "p99 TTFT (ms)"), ("p99_tpot_ms", "p99 TPOT (ms)"))


def tradeoff(report: dict, path: Path) -> Path | None:
    """Per workload, each candidate's output throughput against its p99 TTFT and TPOT."""
    workloads = [w["name"] for w in (report.get("pipeline") or {}).get("bench") or []]
    if not workloads:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(TRADEOFF), figsize=(12, 3.8))
    for ax, (key, label) in zip(axes, TRADEOFF, strict=True):
        for i, workload in enumerate(workloads):
            for entry in _candidates(report):
                m = entry["metrics"]
                x, y = m.get(f"bench.{workload}.{key}"), m.get(f"bench.{workload}.output_throughput")
                if x is None or y is None:
                    continue
                ax.scatter([x], [y], color=f"C{i}", s=40,
                           label=workload if entry is _candidates(report)[0] else None)
                ax.annotate(entry["name"], (x, y), textcoords="offset points", xytext=(5, 3),
                            fontsize=7)
        ax.set_xlabel(label)
        ax.set_ylabel("output tok/s")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="best", fontsize=8, title="workload")
    try:
        return save_png(fig, path)
    finally:
        plt.close(fig)
