"""The run report: JSON (flat vLLM keys + raw arrays + metadata), Rich tables, Markdown;
and the capacity search's section of it (its levels as a table, the knee as a sentence).

A report's file name carries its configuration, as vLLM's do:
``{label}-{rate}qps-c{concurrency}-{model}-{datetime}.json``. The JSON follows
``results/bench-schema.json``.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

from llmctl.bench.metrics import LATENCIES, percentile_key
from llmctl.bench.slo import misses_allowed, parse_bound
from llmctl.utils.atomic import write_text

SCHEMA = "llmctl-bench/1"
DEFINITIONS = {
    "ttft": "send -> first streamed chunk carrying text (client side)",
    "tpot": "(e2el - ttft) / (output tokens - 1), requests with > 1 output token (vLLM); "
            "guidellm's time_per_output_token divides by all output tokens instead",
    "itl": "gaps between consecutive text chunks, pooled over requests",
    "e2el": "send -> end of the stream",
    "request_goodput": "completed requests meeting every SLO, per second",
    "max_output_tokens_per_s": "most text chunks in one 1-second bucket (vLLM)",
    "max_concurrent_requests": "most requests active in one 1-second bucket (vLLM)",
    "peak_concurrency": "most requests in flight at one instant",
    "output_tokens": "server usage when streamed, else re-tokenised text, else chunks",
}
LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}
SUMMARY_ROWS = (
    ("completed", "Successful requests", "{:d}"),
    ("failed", "Failed requests", "{:d}"),
    ("duration", "Benchmark duration (s)", "{:.2f}"),
    ("total_input_tokens", "Total input tokens", "{:d}"),
    ("total_output_tokens", "Total generated tokens", "{:d}"),
    ("request_throughput", "Request throughput (req/s)", "{:.2f}"),
    ("request_goodput", "Request goodput (req/s)", "{:.2f}"),
    ("output_throughput", "Output token throughput (tok/s)", "{:.2f}"),
    ("total_token_throughput", "Total token throughput (tok/s)", "{:.2f}"),
    ("max_output_tokens_per_s", "Peak output token throughput (tok/s)", "{:.2f}"),
    ("peak_concurrency", "Peak concurrent requests", "{:d}"),
)


def rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def slug(text: str) -> str:
    name = Path(text.rstrip("/")).name or text
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "model"


def timestamp(when: _dt.datetime | None = None) -> str:
    return (when or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")


def default_filename(label: str, rate: float, concurrency: int | None, model: str,
                     when: str | None = None) -> str:
    conc = "inf" if not concurrency else str(concurrency)
    return (f"{slug(label)}-{rate_text(rate)}qps-c{conc}-{slug(model)}-"
            f"{when or timestamp()}.json")


def _finite(value):
    """JSON has no inf/nan: inf -> "inf" (a request rate), nan -> null."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(path: Path, report: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(_finite(report), indent=1, allow_nan=False) + "\n")
    return path


def load_json(path: Path) -> dict:
    from llmctl.errors import ConfigError

    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"no report at {path}", "check the path") from None
    except ValueError as exc:
        raise ConfigError(f"{path} is not JSON: {exc}", "pass a report written by llmctl bench "
                          "or vllm bench serve") from None
    if not isinstance(data, dict) or "completed" not in data:
        raise ConfigError(f"{path} is not a benchmark report (no 'completed' key)",
                          "pass a report written by llmctl bench or vllm bench serve")
    return data


def _fmt(value, spec: str = "{:.2f}") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and spec == "{:d}":
        value = int(value)
    try:
        return spec.format(value)
    except (ValueError, TypeError):
        return str(value)


def summary_rows(report: dict) -> list[tuple[str, str]]:
    rows = [(title, _fmt(report.get(key), spec)) for key, title, spec in SUMMARY_ROWS
            if key != "request_goodput" or report.get(key) is not None]
    return rows


def latency_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    percentiles = report.get("percentiles") or []
    header = ["metric (ms)", "mean", "median", "std"] + [percentile_key(p) for p in percentiles]
    rows = []
    for name in LATENCIES:
        keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"] + [
            f"{percentile_key(p)}_{name}_ms" for p in percentiles]
        rows.append([LATENCY_NAMES[name]] + [_fmt(report.get(k)) for k in keys])
    return header, rows


def render(console, report: dict) -> None:
    """vLLM-like result block as two Rich tables, plus the run's warnings."""
    from rich.markup import escape
    from rich.table import Table

    title = (f"{report.get('label')} @ {rate_text_of(report)} req/s, concurrency "
             f"{report.get('max_concurrency') or 'inf'}, {report.get('model_id')}")
    summary = Table(title=title, show_header=False, title_justify="left")
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    for name, value in summary_rows(report):
        summary.add_row(name, value)
    console.print(summary)
    header, rows = latency_rows(report)
    table = Table(title="Latency (TPOT excludes the first token)", title_justify="left")
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for line in diagnosis_lines(report):
        console.print(escape(line))
    for note in notes(report):
        console.print(f"[yellow]note:[/yellow] {note}")


def _pct(value) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def diagnosis_lines(report: dict) -> list[str]:
    """The utilization per phase, each phase's bound with what to do next, and the cost,
    as plain lines (Markdown bullets and the console alike)."""
    util = report.get("utilization") or {}
    if not util.get("available"):
        return [f"utilization: n/a ({util['reason']})"] if util.get("reason") else []
    lines = [(f"utilization ({util['dtype']} products; peaks: {util['peak_source']}; "
              f"from {util['source']}):")]
    for phase, u in util["phases"].items():
        rate = u["achieved_flops_per_s"]
        bw = u["achieved_bytes_per_s"]
        lines.append(f"  {phase}: MFU {_pct(u['mfu'])}, MBU {_pct(u['mbu'])} "
                     f"({'n/a' if rate is None else f'{rate / 1e9:.1f} GFLOP/s'}, "
                     f"{'n/a' if bw is None else f'{bw / 1e9:.2f} GB/s'} over "
                     f"{u['busy_seconds']:.2f} busy s)")
    for v in report.get("verdicts") or []:
        lines.append(f"  {v['phase']} is {v['bound']}-bound")
        for step in v["next"]:
            gain = step["expected_gain"]
            lines.append(f"    next: {step['advice']}"
                         + (f" (expected {gain:.2f}x: {step['gain_basis']})" if gain else ""))
    cost = report.get("cost")
    if cost:
        parts = [f"${cost[k]:.4g} {label}" for k, label in (
            ("usd_per_1m_input_tokens", "per 1M input tokens"),
            ("usd_per_1m_output_tokens", "per 1M output tokens"),
            ("usd_per_request", "per request")) if cost.get(k) is not None]
        lines.append(f"cost at ${cost['usd_per_hour']:g}/h: " + ", ".join(parts)
                     + f" (split {cost['split']})")
    return lines


def rate_text_of(report: dict) -> str:
    rate = report.get("request_rate")
    return rate if isinstance(rate, str) else rate_text(float(rate or math.inf))


def notes(report: dict) -> list[str]:
    out = []
    if report.get("interrupted"):
        out.append("interrupted (Ctrl-C): this is a partial run")
    if report.get("target_down"):
        out.append(f"the target went down: {report['target_down']}; "
                   f"{report.get('not_sent', 0)} requests were not sent (counted as failed)")
    if report.get("failed"):
        errors = [e for e in report.get("errors", []) if e]
        if errors:
            out.append(f"{report['failed']} failed; first error: {errors[0][:200]}")
    if report.get("warmup_failed"):
        out.append(f"{report['warmup_failed']} warm-up requests failed")
    return out


def markdown(report: dict, command: str | None = None) -> str:
    meta = report.get("metadata", {})
    machine = meta.get("machine", {})
    load = machine.get("load_average")
    lines = [f"# llmctl bench: {report.get('label')} / {report.get('model_id')}", ""]
    if command:
        lines += ["```", command, "```", ""]
    lines += [
        (f"- date: {meta.get('date')}; llmctl {meta.get('versions', {}).get('llmctl')} "
         f"({meta.get('llmctl_commit')})"),
        f"- target: {report.get('target')} ({report.get('backend')}, {report.get('endpoint')})",
        (f"- workload: {report.get('dataset', {}).get('name')}, {report.get('num_prompts')} "
         f"prompts, rate {rate_text_of(report)} req/s, burstiness {report.get('burstiness')}, "
         f"max concurrency {report.get('max_concurrency') or 'inf'}, seed {report.get('seed')}"),
        (f"- machine: {machine.get('cpu')}, {machine.get('cores')} cores, load average "
         f"{', '.join(f'{x:.2f}' for x in load) if load else 'n/a'}"),
        "",
        "| metric | value |", "|---|---:|",
    ]
    lines += [f"| {name} | {value} |" for name, value in summary_rows(report)]
    header, rows = latency_rows(report)
    lines += ["", "| " + " | ".join(header) + " |",
              "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    server = report.get("server_metrics") or {}
    if server.get("available"):
        keep = {k: v for k, v in server.items() if k not in ("available",) and v is not None}
        lines += ["", "Server-side (/metrics, after - before): " +
                  ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in keep.items())]
    diagnosis = diagnosis_lines(report)
    if diagnosis:
        lines += ["", "```", *diagnosis, "```"]
    lines += ["", ("TPOT = (E2E - TTFT) / (output tokens - 1), as vLLM; "
                   "guidellm's time_per_output_token includes the first token.")]
    lines += [f"\n> {n}" for n in notes(report)]
    return "\n".join(lines) + "\n"


def sweep_markdown(param: str, rows: Sequence[dict], command: str | None = None) -> str:
    keys = ["request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "p99_tpot_ms", "p99_e2el_ms", "request_goodput", "failed"]
    lines = [f"# llmctl bench sweep over {param}", ""]
    if command:
        lines += ["```", command, "```", ""]
    lines += ["| " + " | ".join([param] + keys) + " |", "|" + "---:|" * (len(keys) + 1)]
    for row in rows:
        cells = [str(row["level"])] + [_fmt(row.get(k), "{:g}" if k == "failed" else "{:.2f}")
                                       for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


LEVEL_HEADERS = {"rate": "rate", "concurrency": "concurrency"}


def _level_text(level: float, by: str) -> str:
    return f"{level:g} req/s" if by == "rate" else f"concurrency {level:g}"


def capacity_result(row: dict) -> str:
    if row["passed"]:
        return "pass"
    return "over-saturated" if row["over_saturated"] else "FAIL"


def capacity_summary(section: dict) -> str:
    """One sentence: the knee and its goodput, or why there is none."""
    by, slo = section["by"], ", ".join(section["slo"])
    knee, stop = section["knee"], section["stop"]
    if knee is None:
        tried = min((row["level"] for row in section["levels"]), default=None)
        lowest = f" (lowest tried: {_level_text(tried, by)})" if tried is not None else ""
        return f"no knee: {section['stop_reason']}{lowest}; SLO {slo}"
    text = (f"knee: {_level_text(knee, by)} meets {slo}, goodput "
            f"{_fmt(section['goodput_at_knee'])} req/s")
    hi = section["bracket"][1]
    if stop == "resolved":
        text += f"; {_level_text(hi, by)} does not"
    elif stop == "maximum":
        text += " (the maximum level: the capacity is at least that)"
    else:
        text += f" (best so far: the search stopped, {section['stop_reason']})"
    if not section["confirmed"]:
        text += "; not confirmed by a repeat"
    return text


def capacity_table(section: dict) -> tuple[list[str], list[list[str]]]:
    """One row per run: the level (a repeat is the phase ``confirm``), its throughput,
    goodput, each bound's statistic in ms with the share of requests meeting it."""
    keys = [text.partition("<=")[0] for text in section["slo"]]  # the limits are in the title
    header = [LEVEL_HEADERS[section["by"]], "phase", "req/s", "out tok/s", "goodput", *keys,
              "result"]
    rows = []
    for row in section["levels"]:
        cells = [f"{row['level']:g}", row["phase"], _fmt(row["request_throughput"]),
                 _fmt(row["output_throughput"]), _fmt(row["request_goodput"])]
        for check in row["slo_checks"]:
            met = check["attained"]
            cells.append(_fmt(check["value_ms"], "{:.1f}")
                         + (f" ({met * 100:.0f}%)" if met is not None else ""))
        rows.append(cells + [capacity_result(row)])
    return header, rows


def capacity_title(section: dict) -> str:
    return f"Capacity search by {section['by']}, SLO {', '.join(section['slo'])}"


def capacity_notes(section: dict) -> list[str]:
    """Levels stopped early, and levels too short for their tightest percentile bound to
    tolerate one slow request (whose verdict a single stall decides)."""
    notes = []
    for row in section["levels"]:
        if row["stopped_early"]:
            notes.append(f"{_level_text(row['level'], section['by'])}: {row['stopped_early']}")
    tightest = max((b.percentile for b in map(parse_bound, section["slo"])
                    if b.percentile is not None), default=None)
    if tightest is not None and tightest < 100:  # p100 is the maximum: no miss, by choice
        short = [row for row in section["levels"] if not row["stopped_early"]
                 and misses_allowed(tightest, row["num_requests"]) == 0]
        if short:
            need = math.ceil(100.0 / (100.0 - tightest) - 1e-9)
            fewest = min(row["num_requests"] for row in short)
            notes.append(
                f"{len(short)} of {len(section['levels'])} levels sent fewer requests (as few "
                f"as {fewest}) than the {need} p{tightest:g} needs to allow one miss: one "
                "request slowed by the machine decides such a level; a longer --duration "
                "makes the search steadier")
    return notes


def capacity_markdown(section: dict) -> str:
    header, rows = capacity_table(section)
    lines = ["", f"## {capacity_title(section)}", "", capacity_summary(section), "",
             "| " + " | ".join(header) + " |",
             "|---:|---|" + "---:|" * (len(header) - 3) + "---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", ("SLO columns: the statistic in ms (share of requests meeting the limit). A "
                   "percentile bound holds when that share of the level's requests (failed ones "
                   "count as misses) meets its limit; an over-saturated level was stopped early "
                   "and fails.")]
    lines += [f"- {note}" for note in capacity_notes(section)]
    if section.get("curve"):
        lines += ["", f"![throughput vs latency]({section['curve']})"]
    return "\n".join(lines) + "\n"


def render_capacity(console, section: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    header, rows = capacity_table(section)
    table = Table(title=capacity_title(section), title_justify="left")
    for i, h in enumerate(header):
        last = i == len(header) - 1
        table.add_column(h, justify="left" if i == 1 or last else "right", no_wrap=last)
    styles = {"pass": "green", "FAIL": "bold red", "over-saturated": "bold red"}
    for row in rows:
        table.add_row(*row[:-1], f"[{styles[row[-1]]}]{row[-1]}[/{styles[row[-1]]}]")
    console.print(table)
    console.print(f"[bold]{escape(capacity_summary(section))}[/bold]")
    for note in capacity_notes(section):
        console.print(f"[yellow]{escape(note)}[/yellow]")
