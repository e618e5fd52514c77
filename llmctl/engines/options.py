"""What a build was asked for: options common to every target, plus target options.

Target-specific options arrive as ``key=value`` strings (``--option`` on the command
line) and are validated by the target's own pydantic model (``Target.Options``), so
a misspelt key fails with the list of the keys that target knows.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmctl.errors import ConfigError, UsageError


class CommonOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    precision: str | None = None  # None: the target's default_precision
    device: Literal["cpu", "cuda"] = "cpu"
    max_batch_size: int = Field(16, ge=1, le=4096)
    max_seq_len: int | None = Field(None, ge=16)


def parse_pairs(pairs: list[str] | None) -> dict[str, str]:
    """``["a=1", "b=x"]`` -> ``{"a": "1", "b": "x"}``."""
    out: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"option {pair!r} is not KEY=VALUE",
                             "write options as --option key=value")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def validate_options(model: type[BaseModel], values: dict, target: str) -> BaseModel:
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}"
                             for e in exc.errors())
        known = ", ".join(model.model_fields) or "none"
        raise ConfigError(f"invalid options for target {target!r}: {problems}",
                          f"options of {target}: {known}") from None
