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


class CapacitySpec(BaseModel):
    """``--find-capacity``: the search space and the SLO a level must meet
    (:mod:`llmctl.bench.capacity`, :mod:`llmctl.bench.slo`)."""

    model_config = ConfigDict(extra="forbid")

    by: str = "rate"
    start: float
    maximum: float
    resolution: str = "10%"
    confirm: int = 1
    early_stop: bool = True
    slo: list[str]  # the bounds' texts, e.g. ["p95_ttft_ms<=500", "p95_tpot_ms<=100"]

    def space(self):
        from llmctl.bench.capacity import SearchSpace, parse_resolution

        return SearchSpace(self.by, self.start, self.maximum,
                           parse_resolution(self.resolution), self.confirm)

    def bounds(self):
        from llmctl.bench.slo import parse_bound

        return tuple(parse_bound(text) for text in self.slo)


# options of --find-capacity: keyword -> flag
CAPACITY_FLAGS = {"by": "--by", "capacity_start": "--capacity-start",
                  "capacity_max": "--capacity-max",
                  "capacity_resolution": "--capacity-resolution",
                  "capacity_confirm": "--capacity-confirm"}


def capacity_from_flags(flags: dict[str, Any], bounds: tuple, *, request_rate: float,
                        sweep: Sweep | None) -> CapacitySpec | None:
    """Pop the capacity flags; None without ``--find-capacity``. Options the search would
    override or that mean another kind of run are usage errors, one line each."""
    from llmctl.bench.capacity import BY, DEFAULT_MAXIMUM, DEFAULT_START
    from llmctl.bench.slo import EXAMPLE

    find = flags.pop("find_capacity", False)
    raw = {flag: flags.pop(key, None) for key, flag in CAPACITY_FLAGS.items()}
    given = {flag: value for flag, value in raw.items() if value is not None}
    early_stop = not flags.pop("no_early_stop", False)
    if not find:
        if given or not early_stop:
            flag = next(iter(given), "--no-early-stop")
            raise UsageError(f"{flag} is an option of --find-capacity", "add --find-capacity "
                             f"and an SLO, e.g. {EXAMPLE}, or drop {flag}")
        if bounds:
            raise UsageError("percentile SLOs (p95_ttft_ms<=500) are the pass rule of "
                             "--find-capacity", "add --find-capacity, or for one run use "
                             "--slo ttft_ms=500 (goodput) or --gate 'p95_ttft_ms<=500'")
        return None
    if not bounds:
        raise UsageError("--find-capacity needs an SLO with percentile bounds",
                         f"e.g. {EXAMPLE}")
    by = given.get("--by", "rate")
    if by not in BY:
        raise UsageError(f"--by {by!r} is not a load dimension", f"use one of: {', '.join(BY)}")
    if sweep is not None:
        raise UsageError("--find-capacity and --sweep both choose the load levels",
                         "use one of them")
    if flags.get("repeat", 1) > 1:
        raise UsageError("--find-capacity repeats the knee itself", "drop --repeat; "
                         "--capacity-confirm sets how often the knee is rerun")
    if by == "rate" and not math.isinf(request_rate):
        raise UsageError("--find-capacity --by rate chooses the request rate",
                         "drop --request-rate (or search --by concurrency at that rate)")
    if by == "concurrency" and flags.get("max_concurrency") is not None:
        raise UsageError("--find-capacity --by concurrency chooses the concurrency",
                         "drop --max-concurrency (or search --by rate under that cap)")
    start = given.get("--capacity-start", DEFAULT_START[by])
    spec = CapacitySpec(by=by, start=start,
                        maximum=given.get("--capacity-max", max(DEFAULT_MAXIMUM[by], start)),
                        resolution=str(given.get("--capacity-resolution", "10%")),
                        confirm=given.get("--capacity-confirm", 1), early_stop=early_stop,
                        slo=[b.text for b in bounds])
    spec.space()  # every check of the search space, before anything runs
    return spec


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
    capacity: CapacitySpec | None = None
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
    # what MFU/MBU are measured against and what a machine-hour costs (llmctl.perf)
    hardware: str | None = None
    peak_flops: float | None = Field(None, gt=0)
    peak_bandwidth: float | None = Field(None, gt=0)
    cost_per_hour: float | None = Field(None, ge=0)
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


def _check_trace_replay(request_rate: float, duration, sweep, capacity) -> None:
    """A trace sets its own arrivals: the flags that set them otherwise are refused."""
    clashes = [name for name, given in (("--request-rate", not math.isinf(request_rate)),
                                        ("--duration", duration is not None),
                                        ("--sweep", sweep is not None),
                                        ("--find-capacity", capacity is not None)) if given]
    if clashes:
        raise UsageError(f"--dataset trace replays the trace's own arrivals: drop "
                         f"{', '.join(clashes)}",
                         "--trace-time-scale replays it faster or slower")


def options_from_flags(**flags: Any) -> BenchOptions:
    """BenchOptions from the command line's flat, textual values: ``dataset`` and
    ``dataset_path`` plus the DatasetSpec fields, ``request_rate`` ("inf" or a number),
    ``percentiles`` ("50,90,99"), ``slo`` (["ttft_ms=500"] or ["p95_ttft_ms<=500,..."]),
    ``sweep`` ("concurrency=1,4"), ``no_plots``, ``metrics_interval`` (0 = off), and the
    capacity search's ``find_capacity``, ``by``, ``capacity_*``, ``no_early_stop``.
    The report's percentiles include those the SLO bounds name."""
    from llmctl.bench.backends import get_backend
    from llmctl.bench.slo import parse_slo_flags, percentiles_needed

    get_backend(flags.get("backend", "openai-completions"))  # unknown: fail before any work
    if flags.get("hardware") not in (None, "this"):
        from llmctl.perf.devices import device_peaks

        device_peaks(flags["hardware"])  # an unknown name: the known ones, before any work
    dataset = {"name": flags.pop("dataset", "random"), "path": flags.pop("dataset_path", None)}
    for key in set(DatasetSpec.model_fields) - {"name", "path"}:
        if key in flags:
            dataset[key] = flags.pop(key)
    slo = parse_slo_flags(flags.pop("slo", None))
    request_rate = parse_rate(flags.pop("request_rate", "inf"))
    sweep = parse_sweep(flags.pop("sweep", None))
    capacity = capacity_from_flags(flags, slo.bounds, request_rate=request_rate, sweep=sweep)
    if dataset["name"] == "trace":
        _check_trace_replay(request_rate, flags.get("duration"), sweep, capacity)
    if dataset["name"] == "multi-turn" and (flags.get("backend") != "openai-chat"
                                            or flags.get("duration") is not None):
        raise UsageError("--dataset multi-turn sends chat histories, for a counted run",
                         "pass --backend openai-chat (and no --duration)")
    percentiles = parse_percentiles(flags.pop("percentiles", "50,90,95,99"))
    return BenchOptions(
        dataset=DatasetSpec(**dataset),
        request_rate=request_rate,
        percentiles=percentiles + [p for p in percentiles_needed(slo.bounds)
                                   if p not in percentiles],
        slos=slo.per_request,
        sweep=sweep,
        capacity=capacity,
        plots=not flags.pop("no_plots", False),
        metrics_interval=flags.pop("metrics_interval", 1.0) or None,
        **flags)
