"""Errors users can act on.

Every error llmctl raises on purpose carries a remedy. The CLI maps these types to
one-line messages and exit codes in one table (``llmctl.cli.errors``); library users
get the same text from ``str(err)``.
"""

from __future__ import annotations


class LlmctlError(Exception):
    """Base class: a problem with a message and what to do about it."""

    exit_code = 1

    def __init__(self, message: str, remedy: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.remedy = remedy

    def __str__(self) -> str:
        return f"{self.message} ({self.remedy})" if self.remedy else self.message


class UsageError(LlmctlError):
    """The command line itself is wrong (exit code 2, as argparse/click use)."""

    exit_code = 2


class NotAvailableYet(UsageError):
    """A command or option that is registered but not implemented."""


class ModelNotFoundError(LlmctlError):
    pass


class NotAModelError(LlmctlError):
    pass


class UnsupportedArchitectureError(LlmctlError):
    pass


class GGUFError(LlmctlError):
    pass


class OfflineError(LlmctlError):
    pass


class MissingDependencyError(LlmctlError):
    pass


class ConfigError(LlmctlError):
    """A recipe, gate file or other configuration that does not validate."""


class ResourceError(LlmctlError):
    """The request would not fit: memory, disk, context length."""


class StepFailedError(LlmctlError):
    """A step of a multi-step command (``llmctl check``) failed: exit code 3, so CI can
    tell a broken pipeline from a failed gate (1) and a malformed one (2)."""

    exit_code = 3
