"""Guard: imports between llmctl's packages flow one way (no cycles).

Every module under ``llmctl/`` is parsed with :mod:`ast`; every ``import llmctl...`` and
``from llmctl... import ...`` counts, at module level, inside functions and under
``TYPE_CHECKING`` alike (a lazy import is still a dependency, it only runs later).

Nodes are the subpackages of ``llmctl`` (``llmctl.serve`` with its ``api``, ``llmctl.engines``,
``llmctl.gguf``, ...) and the top-level modules (``llmctl.errors``, ``llmctl.gates``, ...):
a package is what a reader, a packager or an optional extra treats as one unit, so
``serve`` must not need ``engines`` even from its HTTP layer. Imports inside one node are
free. Lazy imports by string (``importlib`` tables such as ``llmctl.engines.targets.TARGETS``)
are not seen; keep them inside one package.

When two packages need each other, the lower one defines the interface (a protocol, a
registry) and the higher one registers into it: see ``llmctl.serve.engine.sources``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str, root: Path) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def node_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def imported_modules(tree: ast.AST, module: str, is_package: bool, root: Path):
    """(line, llmctl module) for every import in ``tree``, at any depth."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "llmctl":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module.split(".")
                if not is_package:
                    package.pop()
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            if base.split(".")[0] != "llmctl":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"  # `from llmctl.gguf import quants` is a module
                yield node.lineno, sub if is_module(sub, root) else base


def dependency_graph(root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """(from node, to node) -> the import sites ("file:line -> module") that make the edge."""
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for path in sorted((root / "llmctl").rglob("*.py")):
        module = module_name(path, root)
        tree = ast.parse(path.read_text(), filename=str(path))
        source = node_of(module)
        for line, target in imported_modules(tree, module, path.name == "__init__.py", root):
            if node_of(target) != source:
                edges[(source, node_of(target))].add(f"{path.relative_to(root)}:{line} -> {target}")
    return {edge: sorted(sites) for edge, sites in edges.items()}


def cycles(edges) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), sorted."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def describe(component: list[str], edges) -> str:
    lines = [" <-> ".join(component)]
    for (a, b), sites in sorted(edges.items()):
        if a in component and b in component:
            lines.append(f"  {a} -> {b}:")
            lines.extend(f"    {site}" for site in sites)
    return "\n".join(lines)


def test_package_imports_have_no_cycles():
    edges = dependency_graph()
    assert len({a for a, _ in edges}) >= 8, sorted(edges)  # the walk saw the packages
    found = cycles(edges)
    assert not found, "import cycles between llmctl packages:\n" + "\n".join(
        describe(c, edges) for c in found)


# --- the guard itself -------------------------------------------------------------------

def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_guard_sees_function_level_relative_and_from_package_imports(tmp_path):
    root = _tree(tmp_path, {
        "llmctl/__init__.py": "",
        "llmctl/a/__init__.py": "",
        "llmctl/a/x.py": "def f():\n    from llmctl.b import y\n",
        "llmctl/b/__init__.py": "",
        "llmctl/b/y.py": "from ..c import z\n",
        "llmctl/c/__init__.py": "",
        "llmctl/c/z.py": "import llmctl.a.x\n",
        "llmctl/d/__init__.py": "",
        "llmctl/d/w.py": "from llmctl import a\nfrom llmctl.c.z import thing\n",
    })
    edges = dependency_graph(root)
    assert cycles(edges) == [["llmctl.a", "llmctl.b", "llmctl.c"]]
    assert edges[("llmctl.a", "llmctl.b")] == ["llmctl/a/x.py:2 -> llmctl.b.y"]
    assert edges[("llmctl.b", "llmctl.c")] == ["llmctl/b/y.py:1 -> llmctl.c.z"]
    assert ("llmctl.d", "llmctl.a") in edges and ("llmctl.d", "llmctl.c") in edges


# --- inside serve: its sub-packages in one fixed order ------------------------------------

# Lowest first: a sub-package may import only those before it. The kernels know nothing
# of the engine; layers are built on kernels (and take a step's LoRA work); the model is
# built of layers; sampling reads the model's runner (draft models); the engine front
# drives all of them; engine processes wrap the engine; the OpenAI frontend (no HTTP)
# turns OpenAI bodies into engine requests; HTTP wraps the frontend; launching assembles
# all of it; the batch runner composes the frontend too, never the HTTP layer.
SERVE_ORDER = ("kernels", "lora", "layers", "core", "model", "sample", "engine", "proc",
               "openai", "api", "handoff", "launch", "batch")


def serve_edges(root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """(from, to) sub-package of ``llmctl.serve`` -> the import sites that make the edge."""
    def node(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if parts[:2] == ["llmctl", "serve"] and len(parts) > 2 else None

    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for path in sorted((root / "llmctl" / "serve").rglob("*.py")):
        module = module_name(path, root)
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, target in imported_modules(tree, module, path.name == "__init__.py", root):
            a, b = node(module), node(target)
            if a and b and a != b:
                edges[(a, b)].add(f"{path.relative_to(root)}:{line} -> {target}")
    return {edge: sorted(sites) for edge, sites in edges.items()}


def test_serve_is_only_sub_packages_in_the_fixed_order():
    serve = ROOT / "llmctl" / "serve"
    packages = {p.parent.name for p in serve.glob("*/__init__.py")}
    loose = sorted(p.name for p in serve.glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"llmctl/serve/ holds sub-packages only; place these in one: {loose}"
    assert packages == set(SERVE_ORDER), (
        f"every sub-package of llmctl/serve has its place in SERVE_ORDER: "
        f"missing {sorted(packages - set(SERVE_ORDER))}, gone {sorted(set(SERVE_ORDER) - packages)}")


def test_serve_sub_packages_import_only_downward():
    edges = serve_edges()
    assert len(edges) >= 10, sorted(edges)  # the walk saw the sub-packages
    rank = {name: i for i, name in enumerate(SERVE_ORDER)}
    upward = {edge: sites for edge, sites in edges.items() if rank[edge[1]] > rank[edge[0]]}
    assert not upward, "imports up SERVE_ORDER inside llmctl.serve:\n" + "\n".join(
        f"  {a} -> {b}:\n" + "\n".join(f"    {s}" for s in sites)
        for (a, b), sites in sorted(upward.items()))


def test_serve_guard_sees_an_upward_import(tmp_path):
    root = _tree(tmp_path, {
        "llmctl/__init__.py": "",
        "llmctl/serve/__init__.py": "",
        "llmctl/serve/kernels/__init__.py": "",
        "llmctl/serve/kernels/k.py": "def f():\n    from llmctl.serve.engine import e\n",
        "llmctl/serve/engine/__init__.py": "",
        "llmctl/serve/engine/e.py": "from ..kernels import k\n",
    })
    assert serve_edges(root) == {
        ("kernels", "engine"): ["llmctl/serve/kernels/k.py:2 -> llmctl.serve.engine.e"],
        ("engine", "kernels"): ["llmctl/serve/engine/e.py:1 -> llmctl.serve.kernels.k"]}
