"""Load text from a source spec: a local file, a ``datasets`` name or a built-in set.

Specs:
- ``path/to/file.txt`` (one document, or ``--split-lines``-style by paragraphs),
  ``.jsonl`` (a text field, default ``text``), ``.parquet`` (same field);
- ``hf:NAME[:CONFIG][:SPLIT]`` through ``datasets`` (offline-friendly error);
- ``builtin:pydoc-calib`` / ``builtin:pydoc-heldout``: the Python reference manual
  prose in the stdlib's ``pydoc_data.topics`` (PSF licence), split 4:1 by topic so
  calibration and evaluation never see the same text; ``builtin:NAME`` also finds
  ``calibration/NAME.txt|jsonl`` shipped in this repository.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmctl.errors import ConfigError, ModelNotFoundError, OfflineError

REPO_CALIBRATION = Path(__file__).resolve().parents[2] / "calibration"


@dataclass(frozen=True)
class TextSource:
    spec: str
    texts: list[str]

    @property
    def sha256(self) -> str:
        digest = hashlib.sha256()
        for text in self.texts:
            digest.update(text.encode())
            digest.update(b"\0")
        return digest.hexdigest()

    @property
    def characters(self) -> int:
        return sum(len(t) for t in self.texts)


def _pydoc(held_out: bool) -> list[str]:
    from pydoc_data.topics import topics

    keys = sorted(topics)
    return [topics[k] for i, k in enumerate(keys) if (i % 5 == 4) == held_out]


BUILTINS: dict[str, Callable[[], list[str]]] = {
    "pydoc-calib": lambda: _pydoc(held_out=False),
    "pydoc-heldout": lambda: _pydoc(held_out=True),
}


def _from_file(path: Path, field: str) -> list[str]:
    suffix = path.suffix.lower()
    if suffix in (".txt", ".md", ""):
        return [path.read_text(encoding="utf-8", errors="replace")]
    if suffix == ".jsonl":
        texts = []
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"{path}:{lineno} is not JSON: {exc}",
                                  "fix the line or remove it") from None
            if field not in record:
                raise ConfigError(f"{path}:{lineno} has no field {field!r}",
                                  f"pass the text field name (fields: {sorted(record)})")
            texts.append(str(record[field]))
        return texts
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if field not in table.column_names:
            raise ConfigError(f"{path} has no column {field!r}",
                              f"pass the text column (columns: {table.column_names})")
        return [str(v) for v in table.column(field).to_pylist()]
    raise ConfigError(f"cannot read text from {path.suffix} files",
                      "use .txt, .jsonl or .parquet")


def _from_hub(spec: str, field: str) -> list[str]:
    parts = spec.split(":")[1:]
    name, config, split = (parts + [None, None])[:3]
    try:
        import datasets

        data = datasets.load_dataset(name, config, split=split or "train")
    except Exception as exc:  # datasets raises many types when offline
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise OfflineError(f"cannot load dataset {name!r}: {text}",
                           "download it where the hub is reachable and pass a local file") from None
    if field not in data.column_names:
        raise ConfigError(f"dataset {name!r} has no column {field!r}",
                          f"pass the text column (columns: {data.column_names})")
    return [str(t) for t in data[field]]


def load_text_source(spec: str, field: str = "text") -> TextSource:
    if spec.startswith("builtin:"):
        name = spec.split(":", 1)[1]
        if name in BUILTINS:
            return TextSource(spec, BUILTINS[name]())
        for suffix in (".txt", ".jsonl"):
            shipped = REPO_CALIBRATION / f"{name}{suffix}"
            if shipped.is_file():
                return TextSource(spec, _from_file(shipped, field))
        raise ConfigError(f"unknown built-in text set {name!r}",
                          f"built-ins: {', '.join(BUILTINS)}")
    if spec.startswith("hf:"):
        return TextSource(spec, _from_hub(spec, field))
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ModelNotFoundError(f"no text source at {spec!r}",
                                 "pass a .txt/.jsonl/.parquet file, hf:NAME or builtin:pydoc-calib")
    texts = [t for t in _from_file(path, field) if t.strip()]
    if not texts:
        raise ConfigError(f"{spec} holds no text", "pass a file with text in it")
    return TextSource(spec, texts)


def token_stream(tokenizer, source: TextSource) -> list[int]:
    """All documents tokenized and joined with eos between them (no bos)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for text in source.texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
    return ids


def sample_windows(ids: list[int], *, seq_len: int, num: int, seed: int) -> list[list[int]]:
    """``num`` random windows of ``seq_len`` tokens (calibration style)."""
    import random

    if len(ids) < seq_len:
        raise ConfigError(f"the text has {len(ids)} tokens, fewer than one window of {seq_len}",
                          "use more text or a shorter sequence length")
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(ids) - seq_len + 1) for _ in range(num)]
    return [ids[s:s + seq_len] for s in starts]


def fixed_windows(ids: list[int], *, seq_len: int, stride: int | None = None,
                  max_windows: int | None = None) -> list[list[int]]:
    """Consecutive windows of ``seq_len`` (evaluation style); ``stride`` < seq_len overlaps."""
    stride = stride or seq_len
    windows = [ids[s:s + seq_len] for s in range(0, len(ids) - seq_len + 1, stride)]
    return windows[:max_windows] if max_windows else windows
