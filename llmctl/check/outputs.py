"""Write a check's outputs into its directory, each atomically: report.json, report.md,
report.html (self-contained), the figures it shows, and JUnit XML when asked for."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from llmctl.check import html, plots
from llmctl.check.report import junit, markdown
from llmctl.errors import MissingDependencyError
from llmctl.gates import GateResult
from llmctl.utils.atomic import write_text

FIGURES: dict[str, Callable[[dict, Path], Path | None]] = {"pareto": plots.pareto,
                                                           "tradeoff": plots.tradeoff}


def write(report: dict, results: dict[str, list[GateResult]], out_dir: Path,
          junit_path: Path | None, warn: Callable[[str], None] | None = None) -> dict[str, Path]:
    out_dir = Path(out_dir)
    paths = {"json": out_dir / "report.json", "md": out_dir / "report.md",
             "html": out_dir / "report.html"}
    write_text(paths["json"], json.dumps(report, indent=2, default=str))
    write_text(paths["md"], markdown(report))
    figures: dict[str, Path | None] = {}
    for name, draw in FIGURES.items():
        try:
            figures[name] = draw(report, out_dir / f"{name}.png")
        except MissingDependencyError as exc:
            if warn is not None:
                warn(f"no figures in report.html: {exc}")
            break
    write_text(paths["html"], html.render(report, out_dir, figures))
    if junit_path is not None:
        write_text(Path(junit_path), junit(report, results))
        paths["junit"] = Path(junit_path)
    return paths
