"""One table from exception types to what the user sees and the exit code.

Usage errors (exit 2) are the command line's fault: values out of range or not among the
choices, whether typer caught them (:func:`usage_exit`, via the app's group class) or a
typed config object did (a pydantic ``ValidationError``, named by the option that set
the field). Tracebacks are shown only with ``LLMCTL_DEBUG=1``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import typer

from llmctl.errors import LlmctlError, UsageError

EXIT_USAGE = UsageError.exit_code

# Config fields set by an option of another name; every other field `foo_bar` is `--foo-bar`.
FIELD_FLAGS = {
    "num_threads": "--threads",
    "enable_prefix_caching": "--prefix-caching",
    "enable_chunked_prefill": "--chunked-prefill",
    "compute_dtype": "--calib-dtype",
    "slos": "--slo",
    "plots": "--no-plots",
}


def flag_for(field: str) -> str:
    return FIELD_FLAGS.get(field, "--" + field.replace("_", "-"))


def _failed_field(exc: Any) -> str | None:
    fields = [str(p) for p in exc.errors()[0].get("loc", ()) if isinstance(p, str)]
    return flag_for(fields[-1]) if fields else None


def _validation_message(exc: Any) -> str:
    """A pydantic ValidationError as one line naming the option, constraint and value
    (a check across fields has no one option: the message names them)."""
    errors = exc.errors()
    first = errors[0]
    rule = first["msg"].removeprefix("Value error, ")
    rule = rule[:1].lower() + rule[1:]
    value = first.get("input")
    got = f" (got {value!r})" if isinstance(value, (int, float, str)) else ""
    more = f"; and {len(errors) - 1} more problem(s)" if len(errors) > 1 else ""
    flag = _failed_field(exc)
    if flag is None:
        return f"invalid options: {rule}{more}"
    return f"invalid value for '{flag}': {rule}{got}{more}"


def _validation_remedy(exc: Any) -> str:
    flag = _failed_field(exc)
    return f"fix {flag}; -h lists what each option takes" if flag else "see -h"


Text = Callable[[Any], str] | str | None


def _table() -> list[tuple[type[BaseException], Text, Text, int]]:
    """(exception type, message, remedy, exit code); first match wins. Built on first use:
    importing pydantic at start-up would slow every ``--help``."""
    from pydantic import ValidationError

    return [
        (ValidationError, _validation_message, _validation_remedy, EXIT_USAGE),
        (MemoryError, "out of memory", "use a smaller model, batch or --max-tokens", 1),
        (PermissionError, "permission denied: {exc.filename}", "choose a writable path", 1),
        (FileExistsError, "{exc} already exists", "pass --overwrite or pick another output", 1),
        (FileNotFoundError, "file not found: {exc.filename}", "check the path", 1),
        (IsADirectoryError, "{exc.filename} is a directory", "pass a file path", 1),
        (OSError, "{exc}", None, 1),
    ]


def describe(exc: BaseException) -> tuple[str, str | None, int]:
    """Message, remedy and exit code for any exception (our own carry theirs)."""
    if isinstance(exc, LlmctlError):
        return exc.message, exc.remedy, exc.exit_code
    for kind, message, remedy, code in _table():
        if isinstance(exc, kind):
            text = message(exc) if callable(message) else message.format(exc=exc)
            return " ".join(text.split()), remedy(exc) if callable(remedy) else remedy, code
    return f"unexpected error: {type(exc).__name__}: {exc}", (
        "rerun with LLMCTL_DEBUG=1 for a traceback and report it"), 1


def fail(exc: BaseException) -> typer.Exit:
    """Print ``exc`` the one way errors are printed; return the Exit to raise."""
    from llmctl.cli.output import Output

    message, remedy, code = describe(exc)
    Output().error(message, remedy)
    return typer.Exit(code)


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
            raise fail(exc) from None

    return wrapper


@contextlib.contextmanager
def usage_errors() -> Iterator[None]:
    """Errors raised while reading the command line's own values (a --gate, a --sweep)
    are usage errors, whatever type the library gave them."""
    try:
        yield
    except UsageError:
        raise
    except LlmctlError as exc:
        raise UsageError(exc.message, exc.remedy) from None


def usage_exit(exc: Exception, command_path: str) -> typer.Exit:
    """A usage error typer found (bad choice, out of range, missing option) printed like
    every other error: one line naming the option, and a hint."""
    message = exc.format_message().replace("Value error, ", "").replace(  # type: ignore
        ": Input should", ": input should")
    message = message[:1].lower() + message[1:]
    return fail(UsageError(message, f"see `{command_path} -h`"))

