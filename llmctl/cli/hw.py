"""``llmctl hw probe``: measure this CPU's peaks (read and copy bandwidth, matmul per
dtype) for the threads used and cache them per machine; ``llmctl hw show``: the cached
probe. The work is in :mod:`llmctl.hw.probe` and :mod:`llmctl.perf.probe_record`. Both
also say which build of the engine's native kernels runs here (an instruction-set
variant, :func:`llmctl.serve.kernels.cpu.describe_variant`) and why."""

from __future__ import annotations

from typing import Annotated

import typer

from llmctl.cli.errors import guarded
from llmctl.cli.options import JsonOpt

Threads = Annotated[int | None, typer.Option(
    "--threads", min=1, help="torch threads to measure with (default: torch's current count, "
                             "as llmctl runs).")]
Quick = Annotated[bool, typer.Option("--quick", help="Smaller products, fewer runs: about a "
                                                     "second instead of a few, peaks a little "
                                                     "lower.")]
Force = Annotated[bool, typer.Option("--force", help="Measure again even if a probe is "
                                                     "cached.")]


def _threads(threads: int | None) -> int | None:
    from llmctl.errors import UsageError
    from llmctl.utils.cpu import usable_cpus

    cpus = usable_cpus()
    if threads is not None and threads > cpus:
        raise UsageError(f"--threads {threads} is more than the {cpus} CPUs this process may "
                         "run on", f"pass --threads {cpus} or fewer")
    return threads


def _render(record, cached: bool, path):
    from rich.markup import escape
    from rich.table import Table

    peaks = record.peaks()
    kernels = _kernels()

    def render(console) -> None:
        state = (f"cached probe from {record.measured_at} (--force measures again)" if cached
                 else f"measured now, cached in {path}")
        console.print(f"[bold]{escape(record.key.describe())}[/bold]: {escape(state)}")
        table = Table("peak", "value", "measured")
        table.columns[1].no_wrap = True
        for row in record.summary():
            table.add_row(row["peak"], f"{row['value']:,.1f} {row['unit']}",
                          escape(f"{row['path']} {row['what']}"))
        console.print(table)
        console.print(f"source: {escape(peaks.source)}")
        console.print(escape(_kernels_line(kernels)))
        if peaks.memory_bytes:
            console.print(f"memory: {peaks.memory_bytes / 1e9:.1f} GB")
        for note in peaks.notes:
            console.print(f"  - {escape(note)}", style="dim")

    return render


def _kernels() -> dict:
    from llmctl.serve.kernels.cpu import describe_variant

    return describe_variant()


def _kernels_line(kernels: dict) -> str:
    return (f"engine kernels: {kernels['bodies']} bodies ({kernels['why']}); this CPU runs "
            f"{', '.join(kernels['cpu_runs'])}")


def _data(record, cached: bool, path) -> dict:
    return {"cached": cached, "measured_at": record.measured_at, "path": str(path),
            "key": record.key.to_dict(), "quick": record.quick, "summary": record.summary(),
            "peaks": record.peaks().to_dict(), "kernels": _kernels(),
            "measurements": [m.to_dict() for m in record.measurements]}


def _print(out, record, cached: bool, path) -> None:
    busy = record.contention_note()
    if busy:
        out.warn(busy)
    out.result(_data(record, cached, path), _render(record, cached, path))


def _lookup(threads: int | None, out):
    from llmctl.perf.probe_record import current_key, load

    key = current_key(threads)
    lookup = load(key)
    if lookup.problem:
        out.warn(f"ignoring the cached probe {lookup.path}: {lookup.problem}")
    return key, lookup


def probe(threads: Threads = None, quick: Quick = False, force: Force = False,
          json_: JsonOpt = False) -> None:
    """Measure this machine's peaks and cache them.

    With a probe cached for these threads, print it instead; --force measures again, and
    so does a cached probe that was contended, or --quick when this run is not."""
    from llmctl.cli.output import Output

    out = Output(json_mode=json_)
    threads = _threads(threads)
    key, lookup = _lookup(threads, out)
    record = lookup.record
    if record is not None and not force and (quick or not record.quick) \
            and not record.contended():
        _print(out, record, True, lookup.path)
        return
    from llmctl.hw.probe import measure
    from llmctl.perf.probe_record import save

    out.status(f"probing {key.describe()}{' (quick)' if quick else ''}: this takes "
               f"{'about a second' if quick else 'a few seconds'}; keep the machine otherwise idle")
    record = measure(key.threads, quick=quick)
    _print(out, record, False, save(record))


def show(threads: Threads = None, json_: JsonOpt = False) -> None:
    """Print the cached probe of this machine (exit 1 when there is none)."""
    from llmctl.cli.output import Output
    from llmctl.errors import LlmctlError
    from llmctl.perf.probe_record import cached_keys

    out = Output(json_mode=json_)
    key, lookup = _lookup(_threads(threads), out)
    if lookup.record is None:
        others = sorted({k.threads for k in cached_keys()
                         if (k.cpu, k.isa, k.torch) == (key.cpu, key.isa, key.torch)})
        hint = "run `llmctl hw probe`" + (f" (cached for --threads {', '.join(map(str, others))})"
                                          if others else "")
        out.status(_kernels_line(_kernels()))
        raise LlmctlError(f"no cached probe for {key.describe()}", hint)
    _print(out, lookup.record, True, lookup.path)


def register(app: typer.Typer) -> None:
    hw_app = typer.Typer(help="This machine's peak bandwidth and FLOP/s (measured, cached).",
                         no_args_is_help=True)
    hw_app.command("probe")(guarded(probe))
    hw_app.command("show")(guarded(show))
    app.add_typer(hw_app, name="hw")
