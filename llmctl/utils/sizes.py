"""Memory sizes as users write them: ``512MiB``, ``2GB``, or a fraction of free memory."""

from __future__ import annotations

import re

from llmctl.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_memory(value: str | float) -> tuple[str, float]:
    """``"512MiB"`` -> ("bytes", 536870912); ``0.3`` or ``"0.3"`` -> ("fraction", 0.3).

    A bare number up to 1 is a fraction of the memory available after the weights are
    loaded; anything with a unit (or a bare number above 1) is a byte count.
    """
    match = _SIZE.match(str(value))
    if match is None or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read memory size {value!r}",
                          "write e.g. '512MiB', '2GB' or a fraction of free memory like 0.3")
    number, unit = float(match.group(1)), match.group(2).lower()
    if not unit and 0 < number <= 1:
        return "fraction", number
    size = number * _UNITS[unit]
    if size < 1:
        raise ConfigError(f"memory size {value!r} is zero", "give a positive size")
    return "bytes", size
