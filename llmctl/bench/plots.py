"""PNG plots (matplotlib, the optional ``plots`` extra): latency CDFs of a run, and for
a sweep, throughput against p99 latency with the SLO lines."""

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
