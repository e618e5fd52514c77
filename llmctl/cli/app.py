"""Build the Typer app. Command modules import only typer at module level, so
``llmctl --help`` answers without importing torch."""

from __future__ import annotations

import importlib

import typer

# Subcommand modules, in the order ``--help`` lists them.
COMMANDS = ("info", "generate", "quantize", "build_engine", "serve", "bench", "eval")

TYPER_SETTINGS = dict(
    name="llmctl",
    help="Model in, production numbers out: quantize, build, serve, bench and eval LLMs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    rich_markup_mode="rich",
)


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
