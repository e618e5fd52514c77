"""Write outputs so a crash or Ctrl-C never leaves something that looks complete.

Files and directories are built under a hidden temporary name next to the target
(same filesystem, so the final ``os.replace`` is atomic) and renamed at the end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_dir(target: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp directory that becomes ``target`` only if the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            if not overwrite:
                raise FileExistsError(target)
            # Move the old one aside first so there is never a moment with neither.
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """Yield a temp file path that replaces ``target`` only if the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_file(target: Path, mode: str = "wb") -> Iterator:
    """Open a temp file that replaces ``target`` only if the block succeeds."""
    with atomic_path(target) as tmp, open(tmp, mode) as handle:
        yield handle
        handle.flush()
        os.fsync(handle.fileno())


def write_text(target: Path, text: str) -> None:
    with atomic_file(target, "w") as handle:
        handle.write(text)
