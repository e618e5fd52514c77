"""Compare runs side by side, and fold repeated runs into a median and a spread.

The first report is the baseline: every other column shows its value, the delta
(other - baseline) and the ratio (other / baseline). When runs were repeated
(``--repeat N``), the spread (max - min over the repeats) says whether a delta is
larger than the run-to-run noise.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# metric -> True when higher is better (for the verdict column).
COMPARED: dict[str, bool] = {
    "request_throughput": True, "output_throughput": True, "total_token_throughput": True,
    "request_goodput": True, "max_output_tokens_per_s": True,
    "mean_ttft_ms": False, "median_ttft_ms": False, "p99_ttft_ms": False,
    "mean_tpot_ms": False, "median_tpot_ms": False, "p99_tpot_ms": False,
    "median_itl_ms": False, "p99_itl_ms": False,
    "median_e2el_ms": False, "p99_e2el_ms": False,
    "completed": True, "failed": False,
    "prefill_mfu": True, "prefill_mbu": True, "decode_mfu": True, "decode_mbu": True,
    "cost_usd_per_1m_input_tokens": False, "cost_usd_per_1m_output_tokens": False,
    "cost_usd_per_request": False,
}


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def aggregate_repeats(runs: Sequence[dict]) -> dict:
    """Median of every numeric flat metric over the runs, and its spread."""
    keys = [k for k, v in runs[0].items() if _number(v) is not None]
    median, spread = {}, {}
    for key in keys:
        values = [v for r in runs if (v := _number(r.get(key))) is not None]
        if len(values) != len(runs):
            continue
        median[key] = statistics.median(values)
        spread[key] = {"min": min(values), "max": max(values),
                       "stdev": statistics.stdev(values) if len(values) > 1 else 0.0}
    return {"n": len(runs), "median": median, "spread": spread}


@dataclass
class Row:
    metric: str
    values: list[float | None]
    deltas: list[float | None]
    ratios: list[float | None]
    spreads: list[float | None]  # max - min over repeats, per report
    higher_is_better: bool

    def verdict(self, i: int) -> str:
        """'better' / 'worse' / 'same' / 'noise' for column i against the baseline."""
        delta = self.deltas[i]
        if delta is None:
            return ""
        noise = max((s for s in (self.spreads[0], self.spreads[i]) if s is not None),
                    default=None)
        if delta == 0:
            return "same"
        if noise is not None and abs(delta) <= noise:
            return "noise"
        return "better" if (delta > 0) == self.higher_is_better else "worse"


def spread_of(report: dict, key: str) -> float | None:
    entry = (report.get("repeat") or {}).get("spread", {}).get(key)
    return None if entry is None else entry["max"] - entry["min"]


def compare(reports: Sequence[dict], keys: Sequence[str] | None = None) -> list[Row]:
    rows = []
    for key in keys or COMPARED:
        values = [_number(r.get(key)) for r in reports]
        if all(v is None for v in values):
            continue
        base = values[0]
        deltas = [None if base is None or v is None else v - base for v in values]
        ratios = [None if not base or v is None else v / base for v in values]
        rows.append(Row(key, values, deltas, ratios, [spread_of(r, key) for r in reports],
                        COMPARED.get(key, True)))
    return rows


def noise_note(reports: Sequence[dict]) -> str:
    repeats = [(r.get("repeat") or {}).get("n") for r in reports]
    if any(repeats):
        counts = ", ".join(str(n or 1) for n in repeats)
        return (f"runs per report: {counts}. Values are medians ± half their max-min range; "
                "a delta within the larger "
                "max-min spread of the two is marked 'noise'.")
    return ("single runs: no spread known. Repeat with --repeat 3 (or more) to tell a "
            "change from run-to-run noise; on a shared machine compare the load averages.")


def to_dict(rows: Sequence[Row], names: Sequence[str]) -> dict:
    return {"reports": list(names), "rows": [
        {"metric": r.metric, "values": r.values, "deltas": r.deltas, "ratios": r.ratios,
         "spreads": r.spreads, "verdicts": [r.verdict(i) for i in range(len(r.values))]}
        for r in rows]}


def render(console, rows: Sequence[Row], names: Sequence[str], note: str) -> None:
    from rich.table import Table

    for i, name in enumerate(names):
        console.print(f"[bold]#{i + 1}[/bold] {name}" + (" (baseline)" if i == 0 else ""))
    table = Table(title_justify="left")
    table.add_column("metric", no_wrap=True)
    table.add_column("#1", justify="right", no_wrap=True)
    for i in range(2, len(names) + 1):
        table.add_column(f"#{i}", justify="right", no_wrap=True)
        table.add_column("delta", justify="right", no_wrap=True)
        table.add_column("ratio", justify="right", no_wrap=True)
    colours = {"better": "green", "worse": "red", "noise": "dim", "same": "dim"}
    for row in rows:
        cells = [row.metric, _cell(row.values[0], row.spreads[0])]
        for i in range(1, len(names)):
            verdict = row.verdict(i)
            colour = colours.get(verdict, "")
            cells += [_cell(row.values[i], row.spreads[i]),
                      _wrap(_signed(row.deltas[i]), colour),
                      _wrap("-" if row.ratios[i] is None else f"{row.ratios[i]:.3f}x"
                            + (" ~" if verdict == "noise" else ""), colour)]
        table.add_row(*cells)
    console.print(table)
    console.print(f"[dim]{note}[/dim]")


def _cell(value: float | None, spread: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" + (f" ±{spread / 2:.2f}" if spread else "")


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def _wrap(text: str, colour: str) -> str:
    return f"[{colour}]{text}[/{colour}]" if colour else text
