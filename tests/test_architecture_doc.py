"""docs/architecture.md stays true: every path and module it names exists.

The page is the map a newcomer reads first; a renamed file must not leave it pointing at
nothing. Checked: every `backticked` repository path (``llmctl/...``, ``tests/...``,
``benchmarks/...`` ...; a ``:name`` after a ``.py`` path names something in that file)
and every dotted ``llmctl.x.y`` name (a module, or an attribute of one).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
TOPS = ("llmctl/", "tests/", "benchmarks/", "scripts/", "docs/", "recipes/", "results/",
        "examples/", ".ci/")
CODE = re.compile(r"`([^`\n]+)`")


def names_in(text: str) -> tuple[list[str], list[str]]:
    paths, dotted = [], []
    for span in CODE.findall(text):
        for token in re.split(r"[\s,()]+", span):
            token = token.rstrip(".;")
            if token.startswith(TOPS):
                paths.append(token)
            elif re.fullmatch(r"llmctl(\.\w+)+", token):
                dotted.append(token)
    return paths, dotted


def defined_names(path: Path) -> set[str]:
    """Top-level and class-level names a Python file defines."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def missing_path(token: str) -> str | None:
    path, _, name = token.partition(":")
    path = path.rstrip("/")
    if "*" in path:
        return None if list(ROOT.glob(path)) else token
    if not (ROOT / path).exists():
        return token
    if name and path.endswith(".py") and name.split(".")[-1] not in defined_names(ROOT / path):
        return token
    return None


def missing_module(token: str) -> str | None:
    parts = token.split(".")
    for cut in range(len(parts), 0, -1):  # the longest prefix that is a module or package
        base = ROOT.joinpath(*parts[:cut])
        file = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if file.is_file():
            rest = parts[cut:]
            if not rest:
                return None
            return None if rest[-1] in defined_names(file) else token
    return token


def test_every_path_and_module_the_page_names_exists():
    paths, dotted = names_in(DOC.read_text())
    assert len(paths) >= 20, "the page names the code it describes"
    gone = [p for p in paths if missing_path(p)] + [m for m in dotted if missing_module(m)]
    assert gone == [], f"docs/architecture.md names what does not exist: {gone}"


def test_the_page_is_one_page():
    assert len(DOC.read_text().splitlines()) <= 220


def test_the_check_sees_a_wrong_name():
    paths, dotted = names_in("see `llmctl/serve/nothing.py`, `llmctl/serve/engine/llm.py:LLM` "
                             "and `llmctl.serve.engine.llm.Nope` or `llmctl.serve.engine.llm.LLM`")
    assert [p for p in paths if missing_path(p)] == ["llmctl/serve/nothing.py"]
    assert [m for m in dotted if missing_module(m)] == ["llmctl.serve.engine.llm.Nope"]
