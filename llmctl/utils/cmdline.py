"""Command lines as they may be shown or stored: with secrets replaced by ``***``.

Anything that logs a command, prints it or writes it into a report goes through
:func:`redact`; a key typed once must not end up in a log file or a benchmark report.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence

SECRET_FLAGS = ("--api-key", "--api_key", "--token", "--hf-token")
MASK = "***"


def redact(argv: Sequence[str]) -> list[str]:
    """``[..., "--api-key", "K"]`` and ``--api-key=K`` -> the key replaced by ``***``."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(MASK)
            hide_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if flag in SECRET_FLAGS:
            out.append(f"{flag}={MASK}" if eq else arg)
            hide_next = not eq
        else:
            out.append(arg)
    return out


def shell_join(argv: Sequence[str]) -> str:
    """``shlex.join`` that leaves the mask bare: ``--api-key ***``, not ``'***'``."""
    return " ".join(arg if arg.endswith(MASK) else shlex.quote(arg) for arg in argv)


def shown(argv: Sequence[str]) -> str:
    """A command as it may be logged: redacted, shell-quoted."""
    return shell_join(redact(argv))


def redact_text(command: str | None) -> str | None:
    """The same for a command line held as one string (``--serve-args``)."""
    if not command:
        return command
    try:
        return shown(shlex.split(command))
    except ValueError:  # unbalanced quotes: hide everything after a secret flag
        for flag in SECRET_FLAGS:
            if flag in command:
                return command[:command.index(flag) + len(flag)] + " " + MASK
        return command


def command_line() -> str | None:
    """This process's ``llmctl ...`` command as typed (redacted), or None when llmctl
    runs inside another program (tests, a notebook)."""
    if os.path.basename(sys.argv[0]) in ("llmctl", "__main__.py"):
        return shown(["llmctl", *sys.argv[1:]])
    return None
