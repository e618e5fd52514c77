"""report.html: one self-contained page (inline CSS, figures as data: URIs, no script and
no network fetch) with the verdict, the gate table, the candidates and their lineage,
the Pareto front, the throughput/latency trade-off and each run's latency CDFs."""

from __future__ import annotations

import base64
from html import escape
from pathlib import Path

from llmctl.check.report import lineage_parts, verdict_line

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#1b1f24}
h1{font-size:1.4em} .pass{color:#1a7f37} .fail{color:#cf222e}
.verdict{font-size:1.25em;padding:.6em .9em;border-radius:6px;background:#f6f8fa}
table{border-collapse:collapse;margin:.6em 0 1.2em} td,th{border:1px solid #d0d7de;
padding:.3em .6em;text-align:left} th{background:#f6f8fa} td.num{text-align:right}
img{max-width:100%;border:1px solid #d0d7de;margin:.4em 0} code{font-size:.92em}
.warn{color:#9a6700}
"""


def _img(path: Path | None, alt: str) -> str:
    if path is None or not Path(path).is_file():
        return ""
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{data}">'


def _num(value) -> str:
    if value is None:
        return "–"
    return f"{value:.4g}" if isinstance(value, float) else escape(str(value))


def _plain(markdown_text: str) -> str:
    return escape(markdown_text.replace("**", "").replace("`", ""))


def render(report: dict, out_dir: Path, figures: dict[str, Path | None]) -> str:
    v = report["verdict"]
    cls = "pass" if v["passed"] else "fail"
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             "<title>llmctl check report</title>", f"<style>{CSS}</style></head><body>",
             "<h1>llmctl check</h1>",
             f'<p class="verdict {cls}">{_plain(verdict_line(report))}</p>', "<h2>Gates</h2>"]
    rows = [(e["name"], g) for e in report["candidates"] for g in e["gates"]]
    if rows:
        parts.append("<table><tr><th>candidate</th><th>gate</th><th>value</th>"
                     "<th>compared (bound)</th><th>threshold</th><th>pass</th></tr>")
        for name, g in rows:
            ok = "pass" if g["passed"] else "fail"
            parts.append(f"<tr><td>{escape(name)}</td><td><code>{escape(g['gate'])}</code></td>"
                         f'<td class="num">{_num(g["value"])}</td>'
                         f'<td class="num">{_num(g["compared"])}</td>'
                         f'<td class="num">{_num(g["threshold"])}</td>'
                         f'<td class="{ok}">{"yes" if g["passed"] else "no"}</td></tr>')
        parts.append("</table>")
        parts += [f'<p class="warn">warning: {escape(g["warning"])}</p>'
                  for _, g in rows if g.get("warning")]
    else:
        parts.append("<p>No gates.</p>")
    ranking = report.get("ranking") or {}
    parts.append("<h2>Candidates</h2><table><tr><th>candidate</th><th>artifact</th>"
                 f"<th>{escape(ranking.get('quality_metric') or 'quality')}</th>"
                 "<th>throughput (tok/s)</th><th>size (MB)</th><th>Pareto</th><th>steps</th></tr>")
    for e in report["candidates"]:
        m = e["metrics"]
        size = m.get(ranking.get("size_metric") or "")
        steps = ", ".join(f"{s['step']} {s['status']}" for s in e["steps"])
        parts.append(
            f"<tr><td>{escape(e['name'])}</td><td><code>{escape(str(e['artifact']))}</code></td>"
            f'<td class="num">{_num(m.get(ranking.get("quality_metric") or ""))}</td>'
            f'<td class="num">{_num(m.get(ranking.get("throughput_metric") or ""))}</td>'
            f'<td class="num">{_num(size / 1e6 if size else None)}</td>'
            f"<td>{'*' if e['name'] in ranking.get('pareto', []) else ''}</td>"
            f"<td>{escape(steps)}</td></tr>")
    parts.append("</table>")
    parts.append(_img(figures.get("pareto"), "Pareto front: quality against throughput"))
    parts.append(_img(figures.get("tradeoff"), "throughput against p99 latency"))
    for e in report["candidates"]:
        for key, rel in sorted(e["reports"].items()):
            if key.startswith("bench."):
                cdf = (out_dir / rel).with_name(Path(rel).stem + "-cdf.png")
                if cdf.is_file():
                    parts.append(f"<h3>{escape(e['name'])}: {escape(key[6:])} latency CDFs</h3>")
                    parts.append(_img(cdf, f"latency CDFs of {e['name']} {key}"))
    parts.append("<h2>Lineage</h2><ul>")
    for e in report["candidates"]:
        bits = [_plain(b) for b in lineage_parts(e["lineage"])]
        parts.append(f"<li><b>{escape(e['name'])}</b> (artifact "
                     f"<code>{escape(str(e['artifact']))}</code>)<br>{'<br>'.join(bits)}</li>")
    parts.append("</ul>")
    meta = report["metadata"]
    parts.append(f"<p>llmctl {escape(str(meta['versions'].get('llmctl')))}, commit "
                 f"{escape(str(meta.get('llmctl_commit')))}, "
                 f"{escape(str(meta['machine'].get('cpu')))}</p></body></html>")
    return "\n".join(p for p in parts if p) + "\n"
