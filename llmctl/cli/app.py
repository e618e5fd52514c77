"""Build the Typer app. Command modules import only typer at module level, so
``llmctl --help`` answers without importing torch."""

from __future__ import annotations

import importlib

import typer

# typer 0.29 vendors click as typer._click (pyproject pins typer to that minor range).
from typer._click.exceptions import UsageError as ClickUsageError
from typer.core import TyperGroup

# Subcommand modules, in the order ``--help`` lists them.
COMMANDS = ("info", "generate", "quantize", "build_engine", "serve", "batch", "bench", "eval",
            "check", "plan", "hw")


class LlmctlGroup(TyperGroup):
    """Typer's group, except that a usage error typer finds in a subcommand's options is
    printed like every other error (``error: ...`` and a hint, exit 2), not in a box."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except ClickUsageError as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # help, not an error
                raise
            from llmctl.cli.errors import usage_exit

            where = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
            raise usage_exit(exc, where) from None


TYPER_SETTINGS = {
    "name": "llmctl",
    "cls": LlmctlGroup,
    "help": "Model in, production numbers out: quantize, build, serve, bench and eval LLMs.",
    "no_args_is_help": True,
    "add_completion": False,
    "pretty_exceptions_enable": False,
    "context_settings": {"help_option_names": ["-h", "--help"]},
    "rich_markup_mode": "rich",
}


def build_app() -> typer.Typer:
    app = typer.Typer(**TYPER_SETTINGS)

    @app.callback()
    def _root(
        version: bool = typer.Option(False, "--version", help="Print the version and exit."),
    ) -> None:
        if version:
            from llmctl import __version__

            typer.echo(__version__)
            raise typer.Exit()

    for name in COMMANDS:
        importlib.import_module(f"llmctl.cli.{name}").register(app)
    return app


def main() -> None:
    build_app()()
