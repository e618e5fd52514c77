"""OpenAI Batch API files: the input lines, the output lines, and resuming an output.

Input: one JSON object per line, ``{"custom_id", "method": "POST", "url", "body"}``.
Output: one line per input line, in the order they finish (match them by
``custom_id``, as OpenAI's own output files require). The shapes follow what OpenAI's
batch API writes, not only its published schema (openai/openai-openapi#302 shows a
failed line from the service):

- a response, successful or not: ``{"id": "batch_req_...", "custom_id",
  "response": {"status_code", "request_id", "body"}, "error": null}`` where ``body`` is
  the JSON the HTTP API answers, ``{"error": {message, type, param, code}}`` for a 4xx
  or 5xx;
- a line that is no request at all (not JSON, no ``custom_id``, not POST, an endpoint
  not offered): ``"response": null`` and ``"error": {"code", "message", "line"}``, the
  fields of OpenAI's batch validation errors. Without a usable ``custom_id`` it is
  ``null`` and the 1-based input ``line`` number identifies the line.

Resuming: every line already in the output (by ``custom_id``, or by ``line`` for lines
without one) is done. Lines are appended whole and synced before the next batch of
lines, so an interruption leaves at most one partial line at the end, which
:meth:`OutputFile.open` cuts off.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmctl.errors import UsageError

Key = str | int  # a line's identity: its custom_id, or its line number when it has none


@dataclass(frozen=True)
class LineProblem:
    code: str
    message: str


@dataclass(frozen=True)
class InputLine:
    number: int  # 1-based, blank lines counted
    custom_id: str | None
    url: str | None = None
    body: Any = None
    problem: LineProblem | None = None

    @property
    def key(self) -> Key:
        return self.custom_id if self.custom_id is not None else self.number


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _loads(raw: bytes) -> Any:
    # NaN / Infinity are not JSON: refused as the HTTP API refuses them
    return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)


def parse_line(number: int, raw: bytes, urls: tuple[str, ...]) -> InputLine:
    """One input line; a line that is not a request carries its ``problem``."""
    try:
        obj = _loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        return InputLine(number, None, problem=LineProblem(
            "invalid_json_line", f"line {number} is not valid JSON: {exc}"))
    if not isinstance(obj, dict):
        return InputLine(number, None, problem=LineProblem(
            "invalid_json_line", f"line {number} is not a JSON object"))
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return InputLine(number, None, problem=LineProblem(
            "invalid_custom_id", f"line {number}: custom_id must be a non-empty string, got "
                                 f"{json.dumps(custom_id)}"))
    method, url = obj.get("method"), obj.get("url")
    if method != "POST":
        return InputLine(number, custom_id, url, problem=LineProblem(
            "invalid_method", f"line {number}: method must be \"POST\", got "
                              f"{json.dumps(method)}"))
    if url not in urls:
        return InputLine(number, custom_id, problem=LineProblem(
            "invalid_url", f"line {number}: url {json.dumps(url)} is not offered; use one of "
                           f"{', '.join(urls)}"))
    if "body" not in obj:
        return InputLine(number, custom_id, url, problem=LineProblem(
            "missing_body", f"line {number} has no body (the request's JSON)"))
    return InputLine(number, custom_id, url, obj["body"])


def _raw_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based number, bytes) of every non-blank line, read as a stream."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if raw.strip():
                yield number, raw


def read_input(path: Path, urls: tuple[str, ...], skip: set[Key] | frozenset = frozenset()
               ) -> Iterator[InputLine]:
    """The input's request lines not in ``skip``, read as a stream."""
    for number, raw in _raw_lines(path):
        line = parse_line(number, raw, urls)
        if line.key not in skip:
            yield line


def survey_input(path: Path) -> list[Key]:
    """Every line's key, in order; duplicate custom_ids are a usage error (OpenAI refuses
    such a file: custom_id "must be unique for each request in a batch")."""
    keys: list[Key] = []
    seen: dict[str, int] = {}
    for number, raw in _raw_lines(path):
        try:
            custom_id = _loads(raw).get("custom_id")
        except (ValueError, UnicodeDecodeError, RecursionError, AttributeError):
            custom_id = None  # reported as that line's error when it is run
        if not isinstance(custom_id, str) or not custom_id:
            keys.append(number)
            continue
        if custom_id in seen:
            raise UsageError(f"custom_id {custom_id!r} is on lines {seen[custom_id]} and "
                             f"{number} of {path}",
                             "give every line its own custom_id (outputs are matched by it)")
        seen[custom_id] = number
        keys.append(custom_id)
    return keys


# --- output lines ---------------------------------------------------------------------------
def _ids() -> tuple[str, str]:
    return f"batch_req_{uuid.uuid4().hex}", uuid.uuid4().hex


def response_line(custom_id: str, status: int, body: dict) -> dict:
    """A line the endpoint answered: ``status`` 200 with its body, or its error body."""
    line_id, request_id = _ids()
    return {"id": line_id, "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None}


def problem_line(line: InputLine) -> dict:
    """A line that never reached an endpoint."""
    assert line.problem is not None
    return {"id": _ids()[0], "custom_id": line.custom_id, "response": None,
            "error": {"code": line.problem.code, "message": line.problem.message,
                      "line": line.number}}


def failed(line: dict) -> bool:
    response = line.get("response")
    return response is None or response.get("status_code") != 200


def output_key(line: dict) -> Key | None:
    custom_id = line.get("custom_id")
    if isinstance(custom_id, str):
        return custom_id
    number = (line.get("error") or {}).get("line")
    return number if isinstance(number, int) else None


def dumps(line: dict) -> bytes:
    """One output line. ``allow_nan=False``: the HTTP API's JSON encoder refuses NaN and
    infinities too (a body holding one is a 500 there: the caller decides)."""
    try:
        text = json.dumps(line, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8") + b"\n"
    except UnicodeEncodeError:  # a lone surrogate from the input ("\ud800"): keep it escaped
        return json.dumps(line, allow_nan=False, separators=(",", ":")).encode() + b"\n"


# --- the output file ------------------------------------------------------------------------
@dataclass
class Written:
    """What an existing output already holds."""

    keys: set[Key] = field(default_factory=set)
    failed: set[Key] = field(default_factory=set)
    truncated_bytes: int = 0  # a partial last line cut off


class OutputFile:
    """An output opened for appending whole, synced lines."""

    def __init__(self, path: Path, written: Written) -> None:
        self.path = path
        self.written = written
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    @classmethod
    def open(cls, path: Path) -> OutputFile:
        return cls(path, _recover(path))

    def append(self, lines: list[bytes]) -> None:
        """Write ``lines`` (each ending in a newline) and sync them to disk. One write per
        call: a crash inside it leaves complete lines and at most one partial one."""
        if not lines:
            return
        data = b"".join(lines)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def _recover(path: Path) -> Written:
    """Read an existing output: the keys done and failed; a partial last line (no newline:
    an interrupted write) is truncated. A line that is not a batch output line means
    OUTPUT is some other file: refused rather than appended to."""
    written = Written()
    if not path.exists():
        return written
    end = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                break  # the partial last line
            end += len(raw)
            if not raw.strip():
                continue
            try:
                line = _loads(raw)
            except (ValueError, UnicodeDecodeError, RecursionError):
                line = None
            key = output_key(line) if isinstance(line, dict) else None
            if key is None:
                raise UsageError(f"line {number} of {path} is not a batch output line",
                                 "pass -o the output of an earlier `llmctl batch` run to "
                                 "resume it, or a new path")
            written.keys.add(key)
            if failed(line):
                written.failed.add(key)
        size = f.seek(0, os.SEEK_END)
    if size > end:
        os.truncate(path, end)
        written.truncated_bytes = size - end
    return written
