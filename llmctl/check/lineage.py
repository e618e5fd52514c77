"""Names of artifacts and measurements from what made them.

An artifact (a quantized checkpoint, an eval result) is named by the SHA-256 of a
canonical JSON document of its inputs: the model's content hash, the recipe's text, the
calibration token ids' hash, the options, and the versions of llmctl and of the
libraries that compute it. Equal inputs give the same name, so a finished artifact of
that name can be reused; any change (a recipe field, a library upgrade) gives another.

Model content hashes read every file once (~1 s per GB) and are remembered per
(path, size, mtime) in ``$LLMCTL_HOME/check/file-hashes.json``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from llmctl.utils.atomic import write_text

VERSIONED = ("torch", "transformers", "compressed-tensors", "safetensors", "numpy")
# What an engine's bytes depend on beyond VERSIONED, per build target.
ENGINE_VERSIONED: dict[str, tuple[str, ...]] = {
    "onnx": ("onnx", "onnxruntime", "onnxruntime-genai", "onnx-ir"),
    "torch-compile": (),
    "tensorrt-llm": ("tensorrt_llm", "tensorrt-llm"),
}
_CHUNK = 1 << 22


def canonical(document: Any) -> str:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), default=str)


def digest(document: Any) -> str:
    return hashlib.sha256(canonical(document).encode()).hexdigest()


def short(full: str) -> str:
    return full[:16]


# Where an input came from, not what it is: a recipe file's path, the model's name or
# path, the calibration source's name. Their contents are hashed beside them, so an
# artifact keeps its ID when a checkout moves (another CI workspace, another machine).
LOCATION_KEYS = frozenset({"reference", "source"})


def identity(lineage: Any) -> Any:
    """The part of a lineage document that names an artifact (locations left out)."""
    if isinstance(lineage, dict):
        return {k: identity(v) for k, v in lineage.items() if k not in LOCATION_KEYS}
    if isinstance(lineage, list):
        return [identity(v) for v in lineage]
    return lineage


def artifact_id(lineage: Any) -> str:
    return short(digest(identity(lineage)))


def versions(extra: tuple[str, ...] = ()) -> dict[str, str | None]:
    """The versions an artifact's bytes depend on (a change names a new artifact)."""
    from llmctl.report import package_versions

    return package_versions(VERSIONED + tuple(extra))


class FileHashes:
    """Content hashes of files, remembered by (path, size, mtime_ns)."""

    def __init__(self, store: Path) -> None:
        self.store = Path(store)
        try:
            self._known: dict[str, str] = json.loads(self.store.read_text())
        except (OSError, ValueError):
            self._known = {}
        self._dirty = False

    def file(self, path: Path) -> str:
        stat = path.stat()
        key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
        if key not in self._known:
            h = hashlib.sha256()
            with path.open("rb") as handle:
                while chunk := handle.read(_CHUNK):
                    h.update(chunk)
            self._known[key] = h.hexdigest()
            self._dirty = True
        return self._known[key]

    def directory(self, root: Path) -> str:
        """One hash of every regular file under ``root`` (names and contents); files our
        own tools write beside a checkpoint (reports) are left out."""
        root = Path(root)
        files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
        return digest({str(p.relative_to(root)): self.file(p) for p in files})

    def save(self) -> None:
        if self._dirty:
            self.store.parent.mkdir(parents=True, exist_ok=True)
            write_text(self.store, json.dumps(self._known, indent=0, sort_keys=True))
            self._dirty = False
