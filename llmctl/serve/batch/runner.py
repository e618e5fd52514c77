"""``llmctl batch``: an OpenAI Batch API input file run on the engine, without HTTP.

1. Before the model loads: the input's custom_ids (a duplicate is a usage error) and the
   output's lines already written (resuming: those lines are skipped; a partial last
   line from a crash is cut off) (:mod:`llmctl.serve.batch.files`).
2. One engine, in this process, stepped here. Lines enter while fewer than ``window``
   sequences are in flight (default 4 x max_num_seqs: the scheduler always has work
   waiting, and memory stays bounded however long the file), each through the HTTP
   API's own path (:class:`~llmctl.serve.openai.frontend.Frontend`: validation, the
   model name, the chat template, sampling parameters, the submission and the
   collection of outputs, then the engine's own checks), so a line's body is what the
   server would answer, ids and ``created`` aside.
3. After each step, the lines that finished are appended to the output and synced. A
   line's failure (bad JSON, a 400 body, a prompt over the context, a request the
   engine failed) is that line's output, never the batch's end; an exception out of
   ``step()`` is the engine's own fault and ends the run (rerun to resume).

A ``stop`` callable (SIGINT/SIGTERM in the CLI) ends the run after the step in flight:
finished lines are written, the rest is aborted and runs again on resume.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmctl.errors import UsageError
from llmctl.serve.batch import files as batch_file
from llmctl.serve.engine.client import EngineClient
from llmctl.serve.openai import errors
from llmctl.serve.openai.embeddings import EmbeddingAssembly
from llmctl.serve.openai.errors import APIError
from llmctl.serve.openai.frontend import Frontend
from llmctl.serve.openai.jobs import Job
from llmctl.serve.openai.models import ServedModel, vocab_and_grammars
from llmctl.serve.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)
from llmctl.serve.openai.responses import Assembly
from llmctl.serve.openai.submit import submit_all
from llmctl.serve.openai.validation import require_object


@dataclass(frozen=True)
class Endpoint:
    request: type
    serving: Callable[[Frontend], Any]  # its OpenAI serving piece (frontend.chat, ...)


ENDPOINTS = {
    "/v1/chat/completions": Endpoint(ChatCompletionRequest, lambda f: f.chat),
    "/v1/completions": Endpoint(CompletionRequest, lambda f: f.completions),
    "/v1/embeddings": Endpoint(EmbeddingRequest, lambda f: f.embeddings),
}
URLS = tuple(ENDPOINTS)


@dataclass
class BatchSummary:
    lines: int  # request lines in the input
    skipped: int  # already in the output (resumed)
    written: int  # lines this run wrote
    failed: int  # failed lines in the output, earlier runs included
    interrupted: bool
    prompt_tokens: int  # this run's successful lines
    completion_tokens: int
    seconds: float  # first line in to last line out

    @property
    def output_throughput(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "output_throughput": round(self.output_throughput, 2)}


@dataclass
class _Line:
    """One input line in the engine: its requests and the choices they fill."""

    custom_id: str
    assembly: Assembly | EmbeddingAssembly  # the request, its jobs and what they fill
    num_seqs: int
    left: int  # engine requests not finished
    closed: bool = False  # answered: its sequences no longer count in the window


class BatchRunner:
    """Feeds lines to one engine and turns its outputs into output lines."""

    def __init__(self, engine: EngineClient, frontend: Frontend, window: int) -> None:
        self.engine = engine
        self.frontend = frontend
        self.window = max(1, window)
        self._requests: dict[str, tuple[_Line, Job]] = {}  # engine request id -> owner
        self._seqs = 0  # sequences in flight
        self.prompt_tokens = 0
        self.completion_tokens = 0

    @property
    def busy(self) -> bool:
        return bool(self._requests)

    def start(self, line: batch_file.InputLine) -> dict | None:
        """Submit ``line``'s engine requests; or its output line at once when it fails
        before reaching the engine."""
        if line.problem is not None:
            return batch_file.problem_line(line)
        endpoint = ENDPOINTS[line.url]
        try:
            req = self.frontend.validate(require_object(line.body), endpoint.request)
            if req.stream:
                raise errors.bad_request("stream is not available in a batch: each line gets "
                                         "one response body", "stream")
            serving = endpoint.serving(self.frontend)
            jobs, params = serving.jobs(req, serving.encode(req))
            self._submit(jobs, params, req.priority)
        except APIError as exc:
            return batch_file.response_line(line.custom_id, exc.status, exc.body())
        except Exception as exc:  # noqa: BLE001 - a bug: this line's 500, as the server's
            return batch_file.response_line(line.custom_id, 500, _unexpected(exc).body())
        entry = _Line(line.custom_id, self.frontend.assembly(serving.kind, req, jobs),
                      params.n * len(jobs), len(jobs))
        for job in jobs:
            self._requests[job.request_id] = (entry, job)
        self._seqs += entry.num_seqs
        return None

    def _submit(self, jobs: list[Job], params, priority: int) -> None:
        """Every prompt of the line or none (as the server submits, without the queue
        and tenant checks: nothing here can be over a limit but the engine's own)."""
        engine = self.engine
        submit_all(jobs, lambda job: engine.add_request(
            job.request_id, job.prompt_ids, params, priority=priority,
            arrival_time=time.time(), lora=job.lora),
            engine.abort_request, self.frontend.model.model_name)

    @property
    def full(self) -> bool:
        return self._seqs >= self.window

    def step(self) -> list[dict]:
        """One engine step; the output lines of the input lines it finished."""
        done = []
        for out in self.engine.step():
            owner = self._requests.get(out.request_id)
            if owner is None:
                continue  # aborted: its line has already been answered
            line, job = owner
            if out.error is not None:  # this request's own work failed (the server: 500)
                done.append(self._fail(line, errors.internal(f"generation failed: "
                                                             f"{out.error}")))
                continue
            try:
                answer = self._collect(line, job, out)
            except Exception as exc:  # noqa: BLE001 - a bug: this line's 500, as the server's
                answer = self._fail(line, _unexpected(exc))
            if answer is not None:
                done.append(answer)
        return done

    def _collect(self, line: _Line, job: Job, out) -> dict | None:
        """Add an engine output to its line (as the server's non-streaming path does);
        the line's output once its last request finished."""
        line.assembly.collect(job, out)
        if not out.finished:
            return None
        del self._requests[out.request_id]
        line.left -= 1
        if line.left:
            return None
        self._close(line)
        return self._answer(line)

    def _answer(self, line: _Line) -> dict:
        body = line.assembly.body()
        self.prompt_tokens += body["usage"]["prompt_tokens"]
        self.completion_tokens += body["usage"]["completion_tokens"]
        return batch_file.response_line(line.custom_id, 200, body)

    def _fail(self, line: _Line, exc: APIError) -> dict:
        self._close(line)
        return batch_file.response_line(line.custom_id, exc.status, exc.body())

    def _close(self, line: _Line) -> None:
        """The line is answered: abort what of it still runs, free its place."""
        if line.closed:
            return
        line.closed = True
        self._seqs -= line.num_seqs
        for job in line.assembly.jobs:
            if self._requests.pop(job.request_id, None) is not None:
                self.engine.abort_request(job.request_id)

    def abort_all(self) -> None:
        for line in {id(entry): entry for entry, _ in self._requests.values()}.values():
            self._close(line)


def _unexpected(exc: Exception) -> APIError:
    """What the server answers for an exception it did not expect (its 500 handler)."""
    return errors.internal(f"internal server error: {type(exc).__name__}: {exc}")


def _encoded(line: dict) -> tuple[dict, bytes]:
    try:
        return line, batch_file.dumps(line)
    except ValueError as exc:  # NaN/infinity: the server's JSON encoder fails the same (500)
        line = batch_file.response_line(line["custom_id"], 500, _unexpected(exc).body())
        return line, batch_file.dumps(line)


_ANSWERED_MAX = 256  # lines answered without the engine written at a time (memory bound)


def run(runner: BatchRunner, lines: Iterator[batch_file.InputLine],
        output: batch_file.OutputFile, *, stop: Callable[[], bool] = lambda: False,
        on_lines: Callable[[int], None] = lambda count: None) -> tuple[int, int, bool]:
    """Run every line; returns (lines written, of which failed, interrupted)."""
    written = failed = 0

    def write(out_lines: list[dict]) -> None:
        nonlocal written, failed
        if not out_lines:
            return
        encoded = [_encoded(line) for line in out_lines]
        output.append([data for _, data in encoded])
        written += len(encoded)
        failed += sum(batch_file.failed(line) for line, _ in encoded)
        on_lines(len(encoded))

    pending = iter(lines)
    exhausted = False
    while True:
        if stop():
            runner.abort_all()
            return written, failed, True
        answered = []
        while not exhausted and not runner.full and len(answered) < _ANSWERED_MAX:
            line = next(pending, None)
            if line is None:
                exhausted = True
            elif (out := runner.start(line)) is not None:
                answered.append(out)
        write(answered)
        if runner.busy:
            write(runner.step())
        elif exhausted:
            return written, failed, False


def run_batch(input_path: Path, output_path: Path, model: str, engine_kwargs: dict[str, Any],
              *, served_model_name: str | None = None, window: int | None = None,
              stop: Callable[[], bool] = lambda: False,
              progress: Callable[[int, int], None] = lambda done, total: None,
              say: Callable[[str], None] = lambda message: None,
              auto_tool_parser: str | None = None) -> BatchSummary:
    """The whole command: check the files, load the model, run the remaining lines.
    ``auto_tool_parser``: what reads tool_choice "auto" answers (None: such lines fail)."""
    check_paths(input_path, output_path)
    keys = batch_file.survey_input(input_path)  # duplicates fail before the model loads
    output = batch_file.OutputFile.open(output_path)
    try:
        written = output.written
        if written.truncated_bytes:
            say(f"cut a partial last line ({written.truncated_bytes} bytes) off {output_path}")
        skip = written.keys.intersection(keys)
        failed_before = len(written.failed.intersection(keys))
        if skip:
            say(f"resuming: {len(skip)} of {len(keys)} lines are already in {output_path}")
        if len(skip) == len(keys):
            return BatchSummary(len(keys), len(skip), 0, failed_before, False, 0, 0, 0.0)
        runner = _open(model, engine_kwargs, served_model_name, window, say,
                       auto_tool_parser)
        done = len(skip)
        progress(done, len(keys))

        def advance(count: int) -> None:
            nonlocal done
            done += count
            progress(done, len(keys))

        start = time.perf_counter()
        new, failed, interrupted = run(runner, batch_file.read_input(input_path, URLS, skip),
                                       output, stop=stop, on_lines=advance)
        seconds = time.perf_counter() - start
    finally:
        output.close()
    return BatchSummary(len(keys), len(skip), new, failed_before + failed, interrupted,
                        runner.prompt_tokens, runner.completion_tokens, seconds)


def check_paths(input_path: Path, output_path: Path) -> None:
    """Usage errors before anything loads: a missing input, an output we cannot write."""
    import os

    if not input_path.is_file():
        raise UsageError(f"input file not found: {input_path}",
                         "pass a JSONL file of OpenAI batch requests")
    if not os.access(input_path, os.R_OK):
        raise UsageError(f"cannot read {input_path}", "check its permissions")
    parent = output_path.parent
    if output_path.is_dir():
        raise UsageError(f"-o {output_path} is a directory", "pass a file path")
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write the output into {parent}",
                         "pass -o a path in an existing, writable directory")
    if output_path.exists():
        if not os.access(output_path, os.R_OK | os.W_OK):
            raise UsageError(f"cannot read and append to {output_path}",
                             "check its permissions or pass a new -o path")
        if output_path.samefile(input_path):
            raise UsageError("-o is the input file", "write the output to another path")


def _open(model: str, engine_kwargs: dict[str, Any], served_model_name: str | None,
          window: int | None, say: Callable[[str], None],
          auto_tool_parser: str | None = None) -> BatchRunner:
    from llmctl.serve.engine.sources import open_model
    from llmctl.serve.launch.pooling import resolve_pooling

    opened = open_model(model, engine_kwargs)
    engine = opened.engine
    say(engine.kv_plan.describe())
    name, aliases = (served_model_name, ()) if served_model_name else (opened.name,
                                                                       opened.aliases)
    vocab_size, grammars = vocab_and_grammars(engine)
    model = ServedModel(model_name=name, max_model_len=engine.max_model_len,
                        vocab_size=vocab_size, extra_model_names=aliases,
                        hidden_size=engine.spec.hidden_size)
    # /v1/embeddings lines pool as the model's own files say, else the last token's
    frontend = Frontend(engine.tokenizer, model, grammars, engine.lora_names,
                        auto_tool_parser=auto_tool_parser,
                        pooling=resolve_pooling(None, getattr(engine.target, "path", None)))
    return BatchRunner(engine, frontend, window or 4 * engine.config.max_num_seqs)


@contextlib.contextmanager
def stop_on_signals(signals=(signal.SIGINT, signal.SIGTERM)) -> Iterator[Callable[[], bool]]:
    """Yield ``stopped()``, true once one of ``signals`` arrived: the run ends after the
    step in flight with every finished line written. A second SIGINT interrupts at once
    (at worst a partial last line, cut off on resume)."""
    got: list[int] = []

    def handler(signum, frame) -> None:
        if got and signum == signal.SIGINT:
            raise KeyboardInterrupt
        got.append(signum)

    if threading.current_thread() is not threading.main_thread():
        yield lambda: False  # signal handlers can only be set from the main thread
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield lambda: bool(got)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
