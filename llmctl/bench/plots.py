"""PNG plots (matplotlib, the optional ``plots`` extra): latency CDFs of a run, and for
a sweep, throughput against p99 latency with the SLO lines; for a capacity search, the
same trade-off over the levels it ran, with its SLO bounds and the knee."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from llmctl.errors import MissingDependencyError

CDF_PANELS = (("ttfts", "TTFT", "ttft_ms"), ("tpots", "TPOT", "tpot_ms"),
              ("e2els", "E2E latency", "e2el_ms"))
SHORT = {"concurrency": "c", "rate": "qps"}
SWEEP_PANELS = (("p99_ttft_ms", "p99 TTFT", "ttft_ms"), ("p99_tpot_ms", "p99 TPOT", "tpot_ms"),
                ("p99_e2el_ms", "p99 E2E latency", "e2el_ms"))


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise MissingDependencyError("plots need matplotlib",
                                     "pip install 'llmctl[plots]' (or matplotlib)") from None
    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: Path) -> Path:
    from llmctl.utils.atomic import atomic_path

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    return path


def latency_cdfs(report: dict, path: Path) -> Path:
    """Empirical CDFs of TTFT, TPOT and E2E latency (completed requests), in ms."""
    plt = pyplot()
    slos = report.get("slos") or {}
    ok = [not e for e in report.get("errors", [])]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (key, title, slo_key) in zip(axes, CDF_PANELS):
        values = sorted(v * 1000 for v, good in zip(report.get(key, []), ok)
                        if good and v is not None)
        if values:
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, fractions, where="post")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
        if slo_key in slos:
            ax.axvline(slos[slo_key], color="red", linestyle="--", label=f"SLO {slos[slo_key]:g}")
            ax.legend(loc="lower right")
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    fig.suptitle(f"{report.get('label')} / {report.get('model_id')}: latency CDFs")
    try:
        return save_png(fig, path)
    finally:
        plt.close(fig)


def sweep_tradeoff(param: str, rows: Sequence[dict], slos: dict, path: Path) -> Path:
    """Output throughput (x) against p99 latency (y), one point per sweep level."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    xs = [row.get("output_throughput") or 0.0 for row in rows]
    for ax, (key, title, slo_key) in zip(axes, SWEEP_PANELS):
        ys = [row.get(key) for row in rows]
        points = [(x, y, row["level"]) for x, y, row in zip(xs, ys, rows) if y is not None]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o")
            for x, y, level in points:
                ax.annotate(f"{SHORT.get(param, param)}={level}", (x, y),
                            textcoords="offset points",
                            xytext=(4, 4), fontsize=8)
        if slo_key in slos:
            ax.axhline(slos[slo_key], color="red", linestyle="--", label=f"SLO {slos[slo_key]:g}")
            ax.legend(loc="upper left")
        ax.set_title(title)
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
    fig.suptitle(f"sweep over {param}: throughput vs p99 latency")
    try:
        return save_png(fig, path)
    finally:
        plt.close(fig)


# capacity level outcome -> (matplotlib marker, colour)
CAPACITY_MARKS = {"pass": ("o", "tab:green"), "FAIL": ("o", "tab:red"),
                  "over-saturated": ("x", "tab:red")}


def capacity_curve(section: dict, bounds: Sequence, path: Path) -> Path:
    """Request throughput (x) against each bounded statistic (y, one panel per SLO
    bound), one point per run, the bound as a line and the knee's runs starred."""
    from llmctl.bench.report import capacity_result, capacity_summary

    plt = pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, axes = plt.subplots(1, len(bounds), figsize=(4.6 * len(bounds), 3.8), squeeze=False)
    rows = sorted(section["levels"], key=lambda r: (r["level"], r["attempt"]))
    short = SHORT.get(section["by"], section["by"])
    for ax, bound in zip(axes[0], bounds):
        points = [(r["request_throughput"] or 0.0, r[bound.key], r) for r in rows
                  if r.get(bound.key) is not None]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], color="0.6", lw=0.8)
        labelled = set()
        for x, y, row in points:
            result = capacity_result(row)
            marker, colour = CAPACITY_MARKS[result]
            ax.scatter([x], [y], marker=marker, color=colour, zorder=3,
                       label=None if result in labelled else result)
            labelled.add(result)
            if row["attempt"] == 0:
                ax.annotate(f"{short}={row['level']:g}", (x, y), textcoords="offset points",
                            xytext=(4, 4), fontsize=7)
            if row["level"] == section["knee"] and row["attempt"] == 0:
                ax.scatter([x], [y], marker="*", s=260, color="gold", edgecolors="black",
                           zorder=4, label="knee")
        ax.axhline(bound.limit_ms, color="red", linestyle="--", label=f"SLO {bound.text}")
        # Log scale: over-saturated levels sit far above the rest; plain numbers on it.
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_title(bound.key)
        ax.set_xlabel("request throughput (req/s)")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(capacity_summary(section), fontsize=9)
    try:
        return save_png(fig, path)
    finally:
        plt.close(fig)
