"""Which pooling ``/v1/embeddings`` uses: ``--pooling`` when given, else the one the
checkpoint's own files name, else ``last`` (what decoder embedding models such as
Qwen3-Embedding and e5-mistral use, and vLLM's default for decoder models).

A sentence-transformers checkpoint names its pooling beside the weights: ``modules.json``
lists a ``sentence_transformers.models.Pooling`` module whose directory (usually
``1_Pooling``) holds a ``config.json`` with one ``pooling_mode_*`` flag set. Modes the
engine does not compute (CLS, max, weighted mean) are logged and ``last`` is used, so
the server still starts; ``--pooling`` then says which one to use instead.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from llmctl.errors import UsageError
from llmctl.serve.core.pooling import POOLING_TYPES

log = logging.getLogger("llmctl.serve")

DEFAULT_POOLING = "last"
# sentence-transformers' Pooling config flags -> the engine's pooling
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


def model_pooling(model_dir: Path | str | None) -> str | None:
    """The pooling the checkpoint's sentence-transformers files name (None: none, or one
    the engine does not compute, logged)."""
    if model_dir is None:
        return None
    root = Path(model_dir)
    try:
        modules = json.loads((root / "modules.json").read_text())
        module = next(m for m in modules if str(m.get("type", "")).endswith(".Pooling"))
        config = json.loads((root / module.get("path", "1_Pooling") / "config.json")
                            .read_text())
    except (OSError, ValueError, StopIteration, AttributeError, TypeError):
        return None  # no sentence-transformers files, or none naming a pooling
    named = [flag for flag, on in config.items() if flag.startswith("pooling_mode_") and on]
    for flag in named:
        if flag in _MODES:
            return _MODES[flag]
    if named:
        log.warning("the model's pooling (%s) is not one the engine computes; embeddings "
                    "use %r pooling (choose with --pooling)", ", ".join(named), DEFAULT_POOLING)
    return None


def resolve_pooling(flag: str | None, model_dir: Path | str | None) -> str:
    """``--pooling`` checked, else the model's own, else :data:`DEFAULT_POOLING`."""
    if flag is not None:
        if flag not in POOLING_TYPES:
            raise UsageError(f"unknown --pooling {flag!r}",
                             f"choose one of: {', '.join(POOLING_TYPES)}")
        return flag
    return model_pooling(model_dir) or DEFAULT_POOLING
