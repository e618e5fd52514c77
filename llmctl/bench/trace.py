"""Request traces to replay: JSONL in the form Mooncake publishes its production traces
(``mooncake_trace.jsonl``; the same fields in its conversation and tool-agent traces).

One request a line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``timestamp`` is the arrival in milliseconds from the trace's start; ``hash_ids`` name the
prompt's blocks of ``block_tokens`` tokens (512 in Mooncake's traces), in order: two
requests whose lists share a first run of ids share that prompt prefix, which is what a
prefix cache sees. The replay synthesizes the text: the block of id ``h`` is random
vocabulary drawn from a generator seeded by ``(seed, h)``, so equal ids give equal text
in every request of the run (and in every run with the same seed); the prompt is its
blocks joined, its last block cut to the request's ``input_length``. Arrivals keep the
trace's clock, divided by ``time_scale`` (2: twice as fast).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmctl.errors import ConfigError, UsageError

FIELDS = ("timestamp", "input_length", "output_length")


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()


def _request(line: str, where: str) -> TraceRequest:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON ({exc.msg})", "one request object a line") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: not an object", "one request object a line")
    missing = [f for f in FIELDS if f not in row]
    if missing:
        raise ConfigError(f"{where}: no {', '.join(missing)}",
                          f"each line needs {', '.join(FIELDS)} (and hash_ids for shared "
                          "prefixes)")
    try:
        req = TraceRequest(float(row["timestamp"]), int(row["input_length"]),
                           int(row["output_length"]),
                           tuple(int(h) for h in row.get("hash_ids") or ()))
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: timestamp, lengths and hash_ids must be numbers",
                          "fix the trace") from None
    if req.input_length < 1 or req.output_length < 1 or req.timestamp_ms < 0:
        raise ConfigError(f"{where}: lengths must be >= 1 and the timestamp >= 0",
                          "fix the trace")
    return req


def read_trace(path: str | Path) -> list[TraceRequest]:
    """The trace's requests in file order; a bad line is one error naming it."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no trace at {path}", "pass a JSONL trace with --dataset-path")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                out.append(_request(line, f"{path}:{n}"))
    if not out:
        raise ConfigError(f"{path} holds no requests", "one JSON object a line")
    return out


def arrivals(requests: list[TraceRequest], time_scale: float = 1.0) -> list[float]:
    """Send offsets in seconds: the trace's clock from its first request, / time_scale."""
    start = min(r.timestamp_ms for r in requests)
    return [(r.timestamp_ms - start) / 1000.0 / time_scale for r in requests]


def block_ids(request: TraceRequest, index: int, block_tokens: int) -> list[tuple[int, ...]]:
    """The seed key of each block the prompt needs: its hash id, and for blocks past the
    listed ones (a trace that lists fewer) a key of the request's own, so they are shared
    with no other request."""
    needed = -(-request.input_length // block_tokens)
    keys = [(h,) for h in request.hash_ids[:needed]]
    keys += [(-1, index, b) for b in range(len(keys), needed)]
    return keys


def prompt_text(request: TraceRequest, index: int, block_tokens: int,
                block_text: Callable[[tuple[int, ...], int], str]) -> str:
    """The request's prompt: its blocks' texts in order, the last one cut to what is left
    of ``input_length`` (``block_text(key, n_tokens)``: the text of ``n_tokens`` tokens)."""
    keys = block_ids(request, index, block_tokens)
    last = request.input_length - block_tokens * (len(keys) - 1)
    return "".join(block_text(key, block_tokens if i < len(keys) - 1 else last)
                   for i, key in enumerate(keys))
