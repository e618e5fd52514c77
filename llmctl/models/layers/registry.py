"""The lookup of a named block (a RoPE type, an activation): the variants a family can
name in its config.json are tables, and an unknown name is refused with the known ones."""

from __future__ import annotations

from typing import TypeVar

from llmctl.errors import UnsupportedArchitectureError

T = TypeVar("T")


def lookup(table: dict[str, T], name: str, what: str) -> T:
    """``table[name]``; an unknown ``name`` raises naming the ones llmctl implements."""
    try:
        return table[name]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"{what} {name!r} is not supported",
            f"llmctl implements: {', '.join(table)}") from None
