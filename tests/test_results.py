"""Guard: every committed report under ``results/`` was produced from a committed tree.

A number measured on uncommitted code cannot be reproduced by anyone; the benchmark
scripts refuse to write under ``results/`` from a dirty tree (benchmarks/common.py), and
this test keeps a hand-copied or older report from slipping back in.
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _commits(node, path=""):
    if isinstance(node, dict):
        for key, value in node.items():
            if "commit" in key and isinstance(value, str):
                yield f"{path}.{key}", value
            yield from _commits(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _commits(value, f"{path}[{i}]")


def test_no_report_names_a_dirty_tree():
    reports = sorted((ROOT / "results").rglob("*.json"))
    assert reports, "results/ has no reports"
    dirty = [f"{p.relative_to(ROOT)}{where}={commit}" for p in reports
             for where, commit in _commits(json.loads(p.read_text()))
             if commit.endswith("-dirty")]
    assert dirty == [], f"reports made from uncommitted code: {dirty}"


def test_every_markdown_report_has_its_json():
    md = {p.stem for p in (ROOT / "results").glob("*.md") if p.name != "README.md"}
    js = {p.stem for p in (ROOT / "results").glob("*.json")}
    assert sorted(md - js) == []
