"""Where llmctl keeps converted models and other caches."""

from __future__ import annotations

import os
from pathlib import Path


def llmctl_home() -> Path:
    """``$LLMCTL_HOME``, default ``~/.cache/llmctl``; created on first use."""
    root = Path(os.environ.get("LLMCTL_HOME") or Path.home() / ".cache" / "llmctl")
    root.mkdir(parents=True, exist_ok=True)
    return root


def models_dir() -> Path:
    path = llmctl_home() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path
