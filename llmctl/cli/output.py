"""The one output sink: human (Rich) or machine (``--json``) results, plus progress.

Results go to stdout; status, warnings and errors to stderr, so ``--json`` output
stays parseable. Progress bars only appear on an interactive terminal in human mode.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.markup import escape


def _default(obj: Any) -> Any:
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    return str(obj)


class Output:
    def __init__(self, json_mode: bool = False, quiet: bool = False) -> None:
        self.json_mode = json_mode
        self.quiet = quiet
        # Consoles are bound to the streams current at construction (CliRunner swaps them).
        self.console = Console(file=sys.stdout, highlight=False, soft_wrap=True)
        self.err = Console(file=sys.stderr, highlight=False, soft_wrap=True)

    def result(self, data: Any, render: Callable[[Console], None] | None = None) -> None:
        """The command's answer: JSON in json mode, else ``render`` (or pretty JSON)."""
        if self.json_mode or render is None:
            sys.stdout.write(json.dumps(data, indent=2, default=_default) + "\n")
            sys.stdout.flush()
        elif not self.quiet:
            render(self.console)

    # Messages are text, not markup: "pip install 'llmctl[plots]'" must keep its brackets.
    def status(self, message: str) -> None:
        if not (self.json_mode or self.quiet):
            self.err.print(f"[dim]{escape(message)}[/dim]")

    def warn(self, message: str) -> None:
        self.err.print(f"[yellow]warning:[/yellow] {escape(message)}")

    def error(self, message: str, remedy: str | None = None) -> None:
        self.err.print(f"[bold red]error:[/bold red] {escape(message)}")
        if remedy:
            self.err.print(f"  [cyan]hint:[/cyan] {escape(remedy)}")

    @property
    def interactive(self) -> bool:
        return not (self.json_mode or self.quiet) and self.err.is_terminal

    @contextlib.contextmanager
    def progress(self, description: str) -> Iterator[Callable[[int, int], None]]:
        """Yield ``update(done, total)``; a no-op unless a person is watching."""
        if not self.interactive:
            yield lambda done, total: None
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeRemainingColumn(), console=self.err, transient=True) as bar:
            task = bar.add_task(description, total=None)

            def update(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            yield update
