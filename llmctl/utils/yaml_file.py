"""Read a YAML file a user wrote (a pipeline, a recipe, a gate file): a missing file or
broken YAML becomes one line naming the file and the line, raised as the caller's own
error class so each command keeps its exit code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmctl.errors import LlmctlError


def read_yaml(path: str | Path, error: type[LlmctlError], *, what: str,
              remedy: str = "check the path") -> tuple[str, Any]:
    """The file's text and its parsed content."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise error(f"no {what} at {path}", remedy)
    text = path.read_text(encoding="utf-8")
    try:
        return text, yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None)
        raise error(f"{path} is not valid YAML{where}" + (f": {problem}" if problem else ""),
                    "fix the YAML syntax") from None
