"""Guards: every test file is collected, and no package hides from the tools.

pytest's default ``norecursedirs`` (``build``, ``dist``, ``venv``, ``*.egg`` ...) and
ruff's default ``exclude`` silently skip directories with those names: 59 engine tests
once never ran in CI because they lived in ``tests/build/``. These tests fail when that
can happen again.
"""
from __future__ import annotations

import fnmatch
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# pytest's default norecursedirs and the directory names in ruff's default exclude.
HIDDEN_NAMES = (
    "*.egg", ".*", "_darcs", "build", "CVS", "dist", "node_modules", "venv", "{arch}",
    "__pypackages__", "_build", "buck-out", "site-packages", "out", "target",
)


def _package_dirs() -> list[Path]:
    dirs = []
    for top in ("llmctl", "tests"):
        for path in (ROOT / top).rglob("*"):
            if path.is_dir() and path.name != "__pycache__":
                dirs.append(path)
    return dirs


def test_no_package_directory_is_named_like_tool_output():
    hidden = [str(d.relative_to(ROOT)) for d in _package_dirs()
              if any(fnmatch.fnmatch(d.name, pat) for pat in HIDDEN_NAMES)]
    assert hidden == [], f"pytest or ruff skip these directories by default: {hidden}"


def _collected_here(config) -> set[str] | None:
    """The files this session collected, when it was asked for the whole suite (no paths,
    or the tests directory / the repository); None for a partial run."""
    from tests.conftest import COLLECTED_FILES

    whole = {ROOT, ROOT / "tests"}
    args = [a for a in config.args if not a.startswith("-")]
    if not all((ROOT / a.split("::", 1)[0]).resolve() in whole for a in args):
        return None
    return set(COLLECTED_FILES) or None


def _collected_by_subprocess() -> set[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return {line.split("::", 1)[0] for line in proc.stdout.splitlines() if "::" in line}


def test_every_test_file_is_collected(request):
    """A whole-suite run (CI's) reads its own collection (55 s of a second collection saved
    on a slow CPU); a partial run collects the suite in a subprocess."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if "__pycache__" not in p.parts)
    assert len(files) > 50, files
    collected = _collected_here(request.config)
    if collected is None:
        collected = _collected_by_subprocess()
    missing = [f for f in files if f not in collected]
    assert missing == [], f"pytest does not collect these test files: {missing}"


def test_a_file_that_fails_to_import_counts_as_not_collected(pytester):
    """The hook behind the whole-suite shortcut counts only files that yielded tests."""
    pytester.makeconftest(
        "from tests.conftest import pytest_collectreport  # noqa: F401\n")
    pytester.makepyfile(test_good="def test_ok():\n    pass\n",
                        test_broken="import no_such_module_here\n\ndef test_x():\n    pass\n",
                        test_empty="X = 1\n")
    from tests.conftest import COLLECTED_FILES

    before = set(COLLECTED_FILES)
    pytester.inline_run("--collect-only")
    added = {f for f in COLLECTED_FILES - before}
    COLLECTED_FILES.intersection_update(before)
    assert added == {"test_good.py"}
