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


def test_every_test_file_is_collected():
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if "__pycache__" not in p.parts)
    assert len(files) > 50, files
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    collected = {line.split("::", 1)[0] for line in proc.stdout.splitlines() if "::" in line}
    missing = [f for f in files if f not in collected]
    assert missing == [], f"pytest does not collect these test files: {missing}"
