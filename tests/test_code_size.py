"""Guard: modules stay readable in one sitting (issue 33): no file of the package over
600 lines, no function over 80 (the C++ kernels and benchmarks/ are outside the rule).
A file that outgrows this is two concepts; split it where the concepts part."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 80


def oversized(root: Path = ROOT) -> list[str]:
    found = []
    for path in sorted((root / "llmctl").rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(root)
        if len(text.splitlines()) > MAX_FILE_LINES:
            found.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{name}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_file_or_function_is_oversized():
    assert oversized() == []


def test_the_guard_sees_a_long_function_and_a_long_file(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    (tmp_path / "llmctl").mkdir()
    (tmp_path / "llmctl" / "long.py").write_text(f"def f():\n{body}\n" + "\n" * 520)
    assert oversized(tmp_path) == ["llmctl/long.py: 601 lines", "llmctl/long.py:1 f: 81 lines"]
