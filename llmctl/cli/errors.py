"""One table from exception types to what the user sees and the exit code.

Tracebacks are shown only with ``LLMCTL_DEBUG=1``.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import typer

from llmctl.errors import LlmctlError

# (exception type, message template, remedy, exit code); first match wins.
# Our own LlmctlError subclasses carry their message and remedy themselves.
ERROR_TABLE: list[tuple[type[BaseException], str, str | None, int]] = [
    (MemoryError, "out of memory", "use a smaller model, batch or --max-tokens", 1),
    (PermissionError, "permission denied: {exc.filename}", "choose a writable path", 1),
    (FileExistsError, "{exc} already exists", "pass --overwrite or pick another output", 1),
    (FileNotFoundError, "file not found: {exc.filename}", "check the path", 1),
    (IsADirectoryError, "{exc.filename} is a directory", "pass a file path", 1),
    (OSError, "{exc}", None, 1),
]


def describe(exc: BaseException) -> tuple[str, str | None, int]:
    if isinstance(exc, LlmctlError):
        return exc.message, exc.remedy, exc.exit_code
    for kind, template, remedy, code in ERROR_TABLE:
        if isinstance(exc, kind):
            return template.format(exc=exc), remedy, code
    return f"unexpected error: {type(exc).__name__}: {exc}", (
        "rerun with LLMCTL_DEBUG=1 for a traceback and report it"), 1


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a command body, turning known failures into one-line errors + exit codes."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except KeyboardInterrupt:
            sys.stderr.write("interrupted\n")
            raise typer.Exit(130) from None
        except Exception as exc:
            if os.environ.get("LLMCTL_DEBUG") == "1":
                raise
            from llmctl.cli.output import Output

            message, remedy, code = describe(exc)
            Output().error(message, remedy)
            raise typer.Exit(code) from None

    return wrapper


def not_available(command: str, issue: int) -> None:
    """Registered but not built yet: exit 2 with a one-line message."""
    from llmctl.errors import NotAvailableYet

    raise NotAvailableYet(f"`llmctl {command}` is not available yet",
                          f"it is planned in issue #{issue}; see CHANGELOG.md")
