"""A manifest of a converted checkpoint, so a partial or corrupt cache entry is caught.

Each file is recorded with its size and a *quick hash*: SHA-256 over the size and
the first and last MiB. Checking it costs milliseconds even for multi-GB files, and
catches truncation (the common failure) and most overwrites.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from llmctl.utils.atomic import write_text

MANIFEST = "llmctl-manifest.json"
_EDGE = 1 << 20


def quick_hash(path: Path) -> str:
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as handle:
        digest.update(handle.read(_EDGE))
        if size > _EDGE:
            handle.seek(max(_EDGE, size - _EDGE))
            digest.update(handle.read(_EDGE))
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path, source: dict) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "quick_hash": quick_hash(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    write_text(directory / MANIFEST, json.dumps({"source": source, "files": files}, indent=2))


def manifest_problem(directory: Path) -> str | None:
    """None when every file listed is present and intact, else what is wrong."""
    path = directory / MANIFEST
    if not path.is_file():
        return "no manifest"
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError):
        return "unreadable manifest"
    for name, entry in files.items():
        target = directory / name
        if not target.is_file():
            return f"{name} is missing"
        if target.stat().st_size != entry["size"]:
            return f"{name} has the wrong size"
        if quick_hash(target) != entry["quick_hash"]:
            return f"{name} does not match its hash"
    return None
