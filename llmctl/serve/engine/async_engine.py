"""Run the engine's step loop on its own thread and hand outputs to asyncio streams.

The event loop never runs model code and the engine thread never waits on HTTP. They
meet in three places: ``LLMEngine.add_request``/``abort_request`` (thread-safe: they
validate in the caller and queue the change for the next step), ``call_soon_threadsafe``
deliveries into per-request asyncio queues, and a stats snapshot.

Deadline-aware admission (:mod:`llmctl.serve.core.admission`): ``submit`` estimates, from the
last stats snapshot plus the requests submitted since, how long the work queued ahead of
a new request takes, and raises :class:`DeadlineError` at once when it cannot finish
before its deadline (``deadline`` given, else now + ``request_timeout``).

Failures follow the engine's contract (:mod:`llmctl.serve.engine.llm_engine`): a request whose
own work failed gets a final output with ``error``, which its stream raises as
:class:`RequestFailedError` (that request only); one marked ``retryable`` (its engine
process died: :mod:`llmctl.serve.proc.engine`) raises :class:`EngineDeadError`. An
exception out of ``step()`` is the engine's fault: the loop stops, ``alive`` turns false
(``/health`` 503) and every stream ends with :class:`EngineDeadError`. An engine that
reports ``healthy`` (engine processes) is alive only while it says so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from llmctl.serve.core.admission import check_deadline, expected_tokens
from llmctl.serve.engine.client import EngineClient
from llmctl.serve.engine.stats import EngineStats

log = logging.getLogger(__name__)

_STATS_EVERY = 0.1  # seconds between stats snapshots while busy (stats() walks the batch)


class EngineDeadError(RuntimeError):
    """No engine can take or finish the request now (HTTP 503 with Retry-After)."""

    def __init__(self, message: str, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class QueueFullError(RuntimeError):
    pass


class DeadlineError(RuntimeError):
    """The request cannot finish before its deadline given the work queued ahead of it."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestFailedError(RuntimeError):
    """This request's own work failed in the engine (the others go on)."""


def _put_all(puts: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in puts:
        queue.put_nowait(item)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    finished: bool = False


class AsyncEngine:
    def __init__(self, engine: EngineClient, *, max_queue: int | None = None,
                 idle_wait: float = 0.05,
                 request_timeout: float | None = None) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.request_timeout = request_timeout  # the deadline of requests that bring none
        self._idle_wait = idle_wait
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._added_work: list[tuple[tuple, float]] = []  # (admission key, tokens) since then
        self._added_queues: list[tuple] = []  # their queue keys (the queue limit's)
        self._stats = EngineStats()
        self._stats_time = 0.0
        self._fail_request: BaseException | None = None
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.draining = False  # set on shutdown: /health turns 503, new requests 503
        self._thread = threading.Thread(target=self._loop, name="llmctl-engine", daemon=True)

    # --- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self._snapshot()
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        close = getattr(self.engine, "close", None)  # engine processes stop with the loop
        if close is not None:
            close()

    @property
    def alive(self) -> bool:
        return (self._thread.is_alive() and self.error is None and not self._stop.is_set()
                and not self.draining and getattr(self.engine, "healthy", True))

    def stats(self) -> EngineStats:
        """The snapshot taken after a recent step (never touches the engine), with the
        requests submitted since counted as waiting: a snapshot from before a burst of
        submissions must not read as an idle engine."""
        with self._lock:
            stats, added = self._stats, len(self._added_queues)
        if not added:
            return stats
        return dataclasses.replace(stats, num_waiting=stats.num_waiting + added)

    @property
    def num_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    # --- the engine thread ---------------------------------------------------------
    def _snapshot(self) -> None:
        with self._lock:  # no submit in between: each is in the engine's stats or added after
            self._snapshot_locked()

    def _snapshot_locked(self) -> None:
        self._stats = self.engine.stats()
        self._stats_time = time.monotonic()
        self._added_work = []
        self._added_queues = []

    def _deliver(self, request_id: str, item: Any, final: bool) -> None:
        self._deliver_many([(request_id, item, final)])

    def _deliver_many(self, items: list[tuple[str, Any, bool]], snapshot: bool = False
                      ) -> None:
        """Hand a step's outputs to their streams with one wake-up per event loop: each
        ``call_soon_threadsafe`` writes to the loop's self-pipe and takes the GIL to run a
        callback, so at 64 running requests per-item calls cost 64 of each per step.

        ``snapshot``: take the stats snapshot in the same critical section in which the
        finished streams are dropped, before any output goes out: a client reading
        /metrics right after its last response sees its tokens counted, and a snapshot
        that shows the engine idle never coexists with streams still open."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        with self._lock:
            for request_id, item, final in items:
                stream = self._streams.get(request_id)
                if stream is None:
                    continue
                if final:
                    del self._streams[request_id]
                by_loop.setdefault(stream.loop, []).append((stream.queue, item))
            if snapshot:
                self._snapshot_locked()
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_all, puts)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self._fail_request is not None:
                    exc, self._fail_request = self._fail_request, None
                    self._fail_all(exc)
                if not self.engine.has_unfinished_requests():
                    self._snapshot()
                    self._wake.wait(self._idle_wait)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()  # raises only on an engine fault: fatal
                # the step that empties the engine is snapshotted before its outputs go
                # out: a client reading /metrics right after its last response (a bench's
                # closing scrape) sees every token counted, not the idle snapshot before
                snapshot = (not self.engine.has_unfinished_requests()
                            or time.monotonic() - self._stats_time > _STATS_EVERY)
                self._deliver_many([(out.request_id, out, out.finished) for out in outputs],
                                   snapshot)
        except BaseException as exc:  # the engine or the loop broke: the server is unhealthy
            self.error = exc
            log.exception("engine loop died")
        finally:
            reason = "" if self.error is None else f": {type(self.error).__name__}: {self.error}"
            self._fail_all(EngineDeadError(f"the engine stopped{reason}"))

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            ids = list(self._streams)
        for request_id in ids:
            self.engine.abort_request(request_id)
            self._deliver(request_id, exc, final=True)

    def fail_inflight(self, exc: BaseException) -> None:
        """From any thread: end every in-flight request with ``exc`` at the next step."""
        self._fail_request = exc
        self._wake.set()

    # --- the asyncio side ----------------------------------------------------------
    def check_capacity(self) -> None:
        if self.draining:
            raise EngineDeadError("the server is shutting down")
        if not self.alive:
            if self._thread.is_alive() and self.error is None:  # an engine process restarts
                raise EngineDeadError("the engine is restarting; retry shortly",
                                      getattr(self.engine, "retry_after", 5))
            raise EngineDeadError("the engine is not running")

    def _admit(self, prompt_token_ids: list[int], params, priority: int,
               priority_class: str | None, deadline: float | None
               ) -> tuple[tuple[tuple, float], tuple]:
        """Raise :class:`DeadlineError` if the request cannot finish by ``deadline``, or
        :class:`QueueFullError`; else its (admission key, expected tokens) and its queue
        (counted as queued from now on). Under ``_lock``."""
        key = self.engine.admission_key(priority, priority_class)
        queue = self.engine.queue_key(priority_class)
        if self.max_queue is not None:
            # this request's queue: its class's under "fair" (a flood of one class cannot
            # fill the queue against another), everything under "fcfs"
            waiting = dict(self._stats.queued_requests).get(queue, 0) \
                + self._added_queues.count(queue)
            if waiting >= self.max_queue:
                raise QueueFullError(f"{waiting} requests are waiting in this request's queue "
                                     f"(--max-queue {self.max_queue})")
        rate = self._stats.admission_rate
        fraction = rate.output_fraction if rate is not None else 1.0
        max_tokens = params.max_tokens
        if max_tokens is None:  # the engine makes it "up to the context length"
            max_tokens = max(0, self.engine.max_model_len - len(prompt_token_ids))
        max_tokens *= params.n
        own = expected_tokens(len(prompt_token_ids), max_tokens, fraction)
        if deadline is not None:
            queued = self._stats.queued_work
            work = [*queued, *self._added_work]
            refusal = check_deadline(ahead=sum(w for k, w in work if k <= key),
                                     prompt_tokens=len(prompt_token_ids),
                                     max_tokens=max_tokens, left=deadline - time.time(),
                                     rate=rate,
                                     wait_bound=self.engine.wait_bound(priority_class),
                                     ahead_own=sum(w for k, w in work if k == key))
            if refusal is not None:
                raise DeadlineError(refusal.reason(), refusal.retry_after)
        return (key, own), queue

    def submit(self, request_id: str, prompt_token_ids: list[int], params,
               priority: int = 0, **who) -> _Stream:
        """Queue one request; raises at once on a full queue, a deadline it cannot meet
        (:class:`DeadlineError`) or invalid input."""
        self.check_capacity()
        if who.get("deadline") is None and self.request_timeout is not None:
            who["deadline"] = time.time() + self.request_timeout
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        # One critical section with the engine's add: a stats snapshot (taken under the
        # same lock) then counts a request either in the engine or as added since.
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id}")
            work, queue = self._admit(prompt_token_ids, params, priority,
                                      who.get("priority_class"), who.get("deadline"))
            # Validates (context length, token ids) and raises here, in the caller.
            # who: tenant, priority_class, deadline (LLMEngine.add_request)
            self.engine.add_request(request_id, prompt_token_ids, params, priority=priority,
                                    arrival_time=time.time(), **who)
            self._streams[request_id] = stream
            self._added_work.append(work)
            self._added_queues.append(queue)
        self._wake.set()
        return stream

    async def outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[Any]:
        """Yield a submitted request's outputs until it finishes.

        Leaving the iteration early (client gone, timeout, error) aborts the request,
        which frees its KV blocks at the next step boundary.
        """
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    stream.finished = True
                    raise item
                if getattr(item, "error", None) is not None:
                    stream.finished = True
                    if item.retryable:
                        raise EngineDeadError(item.error)
                    raise RequestFailedError(item.error)
                if item.finished:
                    stream.finished = True
                yield item
                if stream.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(request_id)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params,
                       priority: int = 0, **who) -> AsyncIterator[Any]:
        stream = self.submit(request_id, prompt_token_ids, params, priority, **who)
        async for item in self.outputs(request_id, stream):
            yield item

    # --- LoRA adapters: straight to the engine (thread-safe there) ----------------------
    def lora_names(self) -> tuple[str, ...]:
        return self.engine.lora_names()

    def add_lora(self, name: str, path: str) -> None:
        """Blocks while the adapter's tensors are read: call it off the event loop."""
        self.engine.add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        self.engine.remove_lora(name)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        self.engine.abort_request(request_id)
        self._wake.set()
