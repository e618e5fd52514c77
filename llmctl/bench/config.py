"""The typed configuration of a ``llmctl bench`` invocation (recorded in every report)."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_serializer

from llmctl.bench.arrivals import parse_rate
from llmctl.bench.datasets import DatasetSpec
from llmctl.errors import UsageError
from llmctl.utils.cmdline import redact_text

SWEEP_PARAMS = ("concurrency", "rate")


class Sweep(BaseModel):
    model_config = ConfigDict(extra="forbid")

    param: str
    levels: list[float]

    def label(self, level: float) -> str:
        return "inf" if math.isinf(level) else f"{level:g}"

    @field_serializer("levels")
    def _levels(self, levels: list[float]) -> list:
        return [self.label(v) if math.isinf(v) else v for v in levels]


def parse_sweep(text: str | None) -> Sweep | None:
    """``concurrency=1,4,16`` or ``rate=1,2,4,inf`` -> one run per level."""
    if not text:
        return None
    param, sep, values = text.partition("=")
    param = param.strip().replace("max_concurrency", "concurrency").replace("request_rate",
                                                                          "rate")
    if not sep or param not in SWEEP_PARAMS or not values.strip():
        raise UsageError(f"cannot read sweep {text!r}",
                         "write concurrency=1,4,16 or rate=1,2,4,inf")
    levels = []
    for item in values.split(","):
        level = parse_rate(item.strip())
        if param == "concurrency" and not (level.is_integer() and level >= 1):
            raise UsageError(f"concurrency levels must be whole numbers >= 1, got {item!r}",
                             "e.g. --sweep concurrency=1,4,16")
        levels.append(level)
    return Sweep(param=param, levels=levels)


class BenchOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: str | None = None
    model: str | None = None
    served_model_name: str | None = None
    tokenizer: str | None = None
    backend: str = "openai-completions"
    endpoint: str | None = None
    dataset: DatasetSpec = Field(default_factory=DatasetSpec)
    request_rate: float = math.inf
    burstiness: float = Field(1.0, gt=0)
    max_concurrency: int | None = Field(None, ge=1)
    warmup: int = Field(0, ge=0)
    duration: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    temperature: float = Field(0.0, ge=0)
    percentiles: list[float] = Field(default_factory=lambda: [50.0, 90.0, 95.0, 99.0])
    slos: dict[str, float] = Field(default_factory=dict)
    sweep: Sweep | None = None
    repeat: int = Field(1, ge=1)
    label: str | None = None
    result_dir: str = "."
    result_filename: str | None = None
    request_timeout: float = Field(600.0, gt=0)
    metrics_interval: float | None = Field(1.0, gt=0)
    server_command: str | None = None
    serve_args: str | None = None
    server_timeout: float = Field(600.0, gt=0)
    # dtype of the llmctl serve that bench starts ("auto": see llmctl.utils.device)
    dtype: str = "auto"
    plots: bool = True

    @field_serializer("request_rate", "burstiness")
    def _inf(self, value: float):
        return "inf" if math.isinf(value) else value

    @field_serializer("serve_args", "server_command")
    def _redacted(self, value: str | None) -> str | None:
        return redact_text(value)  # reports keep the command, never a key in it

    @property
    def run_label(self) -> str:
        return self.label or self.backend


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < v <= 100 for v in values):
        raise UsageError(f"cannot read percentiles {text!r}",
                         "write a comma-separated list in (0, 100], e.g. 50,90,95,99")
    return values


def options_from_flags(**flags: Any) -> BenchOptions:
    """BenchOptions from the command line's flat, textual values: ``dataset`` and
    ``dataset_path`` plus the DatasetSpec fields, ``request_rate`` ("inf" or a number),
    ``percentiles`` ("50,90,99"), ``slo`` (["ttft_ms=500"]), ``sweep``
    ("concurrency=1,4"), ``no_plots``, ``metrics_interval`` (0 = off)."""
    from llmctl.bench.backends import get_backend
    from llmctl.bench.metrics import parse_slos

    get_backend(flags.get("backend", "openai-completions"))  # unknown: fail before any work
    dataset = {"name": flags.pop("dataset", "random"), "path": flags.pop("dataset_path", None)}
    for key in set(DatasetSpec.model_fields) - {"name", "path"}:
        if key in flags:
            dataset[key] = flags.pop(key)
    return BenchOptions(
        dataset=DatasetSpec(**dataset),
        request_rate=parse_rate(flags.pop("request_rate", "inf")),
        percentiles=parse_percentiles(flags.pop("percentiles", "50,90,95,99")),
        slos=parse_slos(flags.pop("slo", None)),
        sweep=parse_sweep(flags.pop("sweep", None)),
        plots=not flags.pop("no_plots", False),
        metrics_interval=flags.pop("metrics_interval", 1.0) or None,
        **flags)
