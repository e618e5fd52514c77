"""Which compressed-tensors scheme and format apply to each linear layer of a checkpoint:
its config.json ``quantization_config`` (``config_groups`` with their ``targets``,
``ignore``, ``format``) matched the way compressed-tensors matches it. The layers' own
tensors are read by :func:`llmctl.serve.layers.quant_linear.load_quant_weight`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmctl.errors import UnsupportedArchitectureError


def _matches(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    # a class name ("Linear") targets every linear layer; else a module name or suffix
    return target == "Linear" or name == target or name.endswith("." + target)


@dataclass
class QuantScheme:
    args: dict  # the weights' QuantizationArgs as stored
    format: str


class QuantConfig:
    """Which scheme and format apply to each linear layer of a checkpoint."""

    def __init__(self, config: dict | None) -> None:
        self.config = config or {}
        method = self.config.get("quant_method")
        if config and method != "compressed-tensors":
            raise UnsupportedArchitectureError(
                f"quantization method {method!r} is not supported by the engine",
                "serve a compressed-tensors checkpoint (llmctl quantize writes them)")
        self.groups = list((self.config.get("config_groups") or {}).values())
        self.ignore = list(self.config.get("ignore") or [])
        self.format = self.config.get("format") or "dense"

    def __bool__(self) -> bool:
        return bool(self.groups)

    def scheme_for(self, name: str) -> QuantScheme | None:
        if not self.groups or any(_matches(name, t) for t in self.ignore):
            return None
        for group in self.groups:
            if group.get("weights") and any(_matches(name, t) for t in group.get("targets", [])):
                fmt = group.get("format") or self.format
                if fmt == "mixed-precision":
                    fmt = "pack-quantized" if group["weights"].get("type") == "int" \
                        else "float-quantized"
                return QuantScheme(args=group["weights"], format=fmt)
        return None
