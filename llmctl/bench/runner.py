"""Orchestration of one measured run: warm-up, arrivals, concurrency cap, records.

The run never raises because of the target: a request that fails is a record. When
the target goes down (a launched server exits, or requests keep being refused) the
schedule stops, in-flight requests finish or fail, and every request not yet sent is
recorded as failed. Ctrl-C stops the schedule, cancels what is in flight (recorded as
failed, "interrupted") and returns what was measured, marked ``interrupted``.

A :class:`Watcher` sees the run as it goes (each send, each finished request, each
/metrics sample) and may stop it early, as Ctrl-C does but marked ``stopped`` with its
reason: the capacity search stops a level that is over-saturated this way
(:mod:`llmctl.bench.saturation`).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import httpx
import numpy as np

from llmctl.bench import arrivals, server_metrics
from llmctl.bench.backends import Backend, RequestSettings, send_request
from llmctl.bench.records import RequestRecord, SampleRequest
from llmctl.errors import LlmctlError

# This many refused connections in a row, with nothing succeeding in between, means
# the target is gone (a single refusal can be a full accept queue).
DOWN_AFTER_REFUSALS = 3


@dataclass(frozen=True)
class RunPlan:
    samples: list[SampleRequest]
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    warmup: int = 0
    initial_check: bool = True  # one test request first (as vLLM): fail fast, warm the client
    duration: float | None = None  # stop sending after this many seconds (cycles samples)
    seed: int = 0
    request_timeout: float = 600.0
    metrics_interval: float | None = 1.0  # seconds between /metrics samples; None = off


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration: float
    interrupted: bool = False
    target_down: str | None = None
    not_sent: int = 0
    warmup_failed: int = 0
    server_before: dict | None = None
    server_after: dict | None = None
    server_samples: list[dict] = field(default_factory=list)
    stopped: str | None = None  # why a watcher stopped the run early

    @property
    def server_summary(self) -> dict:
        return server_metrics.summarize(self.server_before, self.server_after,
                                        self.server_samples)


class Watcher(Protocol):
    """Sees a run as it goes; times are seconds since the measurement started."""

    def sent(self, t: float, in_flight: int) -> None: ...

    def finished(self, t: float, record: RequestRecord, in_flight: int) -> None: ...

    def scraped(self, t: float, values: dict[str, float]) -> None: ...

    def stop_reason(self, t: float) -> str | None:
        """Why the run should stop now, or None to go on."""


class Halt:
    """Why the schedule stops early: Ctrl-C, a dead target or a watcher. Wakes any waiter."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.interrupted = False
        self.target_down: str | None = None
        self.stopped: str | None = None

    def interrupt(self) -> None:
        self.interrupted = True
        self.event.set()

    def stop(self, reason: str) -> None:
        if self.stopped is None:
            self.stopped = reason
        self.event.set()

    @property
    def cancels(self) -> bool:
        """Requests in flight are cancelled (Ctrl-C, a watcher), not waited for."""
        return self.interrupted or self.stopped is not None

    @property
    def cancel_note(self) -> str:
        return "interrupted" if self.interrupted else f"stopped early: {self.stopped}"

    def down(self, reason: str) -> None:
        if self.target_down is None:
            self.target_down = reason
        self.event.set()


def schedule(plan: RunPlan) -> Iterator[tuple[int, SampleRequest, float]]:
    """(index, sample, send offset in seconds). Counted runs send each sample once on a
    vLLM-normalised schedule; duration runs cycle the samples on an open-ended one."""
    rng = np.random.default_rng([plan.seed, 1])  # independent of the dataset's stream
    if plan.samples and plan.samples[0].arrival is not None:  # a trace's own clock, once
        order = sorted(range(len(plan.samples)), key=lambda i: plan.samples[i].arrival)
        yield from ((i, plan.samples[i], plan.samples[i].arrival) for i in order)
        return
    if plan.duration is None:
        times = arrivals.offsets(len(plan.samples), plan.request_rate, plan.burstiness, rng)
        yield from ((i, s, t) for i, (s, t) in enumerate(zip(plan.samples, times)))
        return
    gaps = arrivals.gaps(plan.request_rate, plan.burstiness, rng)
    offset = 0.0
    for i, sample in enumerate(itertools.cycle(plan.samples)):
        offset += next(gaps)
        yield i, sample, offset


async def _wait(halt: Halt, seconds: float) -> None:
    if seconds > 0:
        try:
            await asyncio.wait_for(halt.event.wait(), seconds)
        except asyncio.TimeoutError:
            pass


async def _acquire(sem: asyncio.Semaphore | None, halt: Halt) -> bool:
    """Take a concurrency slot unless the run is halted first."""
    if sem is None:
        return not halt.event.is_set()
    acquire = asyncio.ensure_future(sem.acquire())
    halted = asyncio.ensure_future(halt.event.wait())
    await asyncio.wait({acquire, halted}, return_when=asyncio.FIRST_COMPLETED)
    halted.cancel()
    if not acquire.done():
        acquire.cancel()
        return False
    if halt.event.is_set():
        sem.release()
        return False
    return True


async def probe(base_url: str, api_key: str | None = None) -> dict:
    """Reach the target before measuring: its served models and ``Server`` header."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            resp = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
    except httpx.HTTPError as exc:
        raise LlmctlError(f"cannot reach the target {base_url}: {type(exc).__name__} {exc}",
                          "start the server first, check --target (scheme, host, port), "
                          "or leave out --target to start llmctl's own server") from None
    models: list[str] = []
    if resp.status_code == 200:
        try:
            models = [m.get("id") for m in resp.json().get("data", []) if isinstance(m, dict)]
        except ValueError:
            pass
    return {"models": models, "server": resp.headers.get("server"),
            "models_status": resp.status_code}


async def run(plan: RunPlan, backend: Backend, settings: RequestSettings, *,
              halt: Halt | None = None, alive: Callable[[], bool] | None = None,
              progress: Callable[[int, int], None] | None = None,
              watcher: Watcher | None = None) -> RunResult:
    halt = halt or Halt()
    limits = httpx.Limits(max_connections=plan.max_concurrency,
                          max_keepalive_connections=plan.max_concurrency)
    timeout = httpx.Timeout(plan.request_timeout, connect=10.0)
    sem = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        warmup_failed = await _warm_up(client, plan, backend, settings, sem, halt)
        before = await server_metrics.scrape(client, settings.base_url)  # after the warm-up
        sender = _Sender(client, plan, backend, settings, sem, halt, alive=alive,
                         progress=progress, watcher=watcher)
        sampler = None
        if before is not None and plan.metrics_interval:
            sampler = asyncio.ensure_future(_sample_metrics(
                client, settings.base_url, plan.metrics_interval, sender.scraped))
        await sender.send_all()
        duration = time.perf_counter() - sender.origin
        samples = []
        if sampler is not None:
            sampler.cancel()
            samples = await sampler
        after = await server_metrics.scrape(client, settings.base_url) if before else None
    records = sender.records
    not_sent = _record_unsent(records, sender.launched, sender.pending, plan, halt)
    records.sort(key=lambda r: r.index)
    return RunResult(records, duration, halt.interrupted, halt.target_down, not_sent,
                     warmup_failed, before, after, samples, halt.stopped)


async def _warm_up(client, plan: RunPlan, backend: Backend, settings: RequestSettings,
                   sem: asyncio.Semaphore | None, halt: Halt) -> int:
    """:func:`_warmup` until Ctrl-C: the failed warm-up requests (all of them when it
    was interrupted; nothing was measured yet)."""
    warmup = asyncio.ensure_future(_warmup(client, plan, backend, settings, sem))
    halted = asyncio.ensure_future(halt.event.wait())
    await asyncio.wait({warmup, halted}, return_when=asyncio.FIRST_COMPLETED)
    halted.cancel()
    if not warmup.done():  # Ctrl-C during the warm-up: nothing was measured yet
        warmup.cancel()
        await asyncio.gather(warmup, return_exceptions=True)
    return warmup.result() if not warmup.cancelled() else plan.warmup


class _Sender:
    """The measured part of a run: sends the schedule's requests on time under the
    concurrency cap, records each, tells the watcher, and stops when the halt says."""

    def __init__(self, client, plan: RunPlan, backend: Backend, settings: RequestSettings,
                 sem: asyncio.Semaphore | None, halt: Halt, *,
                 alive: Callable[[], bool] | None, progress: Callable[[int, int], None] | None,
                 watcher: Watcher | None) -> None:
        self.client, self.plan, self.backend, self.settings = client, plan, backend, settings
        self.sem, self.halt, self.alive = sem, halt, alive
        self.progress, self.watcher = progress, watcher
        self.total = None if plan.duration else sum(
            s.conversation.requests if s.conversation is not None else 1 for s in plan.samples)
        self.next_index = len(plan.samples)  # a conversation's later turns count on from here
        self.follow_ups: list[asyncio.Task] = []
        self.records: list[RequestRecord] = []
        self.refusals = 0  # connections refused in a row
        self.in_flight = 0
        self.launched: list[tuple[int, SampleRequest]] = []
        self.pending: list[tuple[int, SampleRequest]] = []  # never sent
        self.origin = time.perf_counter()  # the schedule's time 0

    def watch(self, event: Callable[[float], None]) -> None:
        if self.watcher is None:
            return
        now = time.perf_counter() - self.origin
        event(now)
        if (reason := self.watcher.stop_reason(now)) is not None:
            self.halt.stop(reason)

    def scraped(self, values: dict) -> None:
        self.watch(lambda now: self.watcher.scraped(now, values))

    async def send_all(self) -> None:
        """Every request of the schedule, each at its offset; returns when all sent have
        finished (or, on Ctrl-C, been cancelled)."""
        plan, halt, sem, origin = self.plan, self.halt, self.sem, self.origin
        tasks: list[asyncio.Task] = []
        for index, sample, offset in schedule(plan):
            if plan.duration is not None and offset > plan.duration:
                break
            if halt.event.is_set():
                if plan.duration is not None or halt.cancels:
                    break
                self.pending.append((index, sample))  # the target is down: record, don't send
                continue
            await _wait(halt, origin + offset - time.perf_counter())
            if self.alive is not None and not self.alive():
                halt.down("the server process exited")
            if not await _acquire(sem, halt):
                self.pending.append((index, sample))
                continue
            if plan.duration is not None and time.perf_counter() - origin > plan.duration:
                if sem is not None:
                    sem.release()
                break
            self.launched.append((index, sample))
            self.in_flight += 1
            tasks.append(asyncio.ensure_future(self.one(index, sample, offset)))
            self.watch(lambda now, n=self.in_flight: self.watcher.sent(now, n))
        if halt.cancels:
            for task in tasks:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        while self.follow_ups:  # conversations' later turns, each started by its answer
            batch, self.follow_ups = self.follow_ups, []
            if halt.cancels:
                for task in batch:
                    task.cancel()
            await asyncio.gather(*batch, return_exceptions=True)

    async def follow_up(self, sample: SampleRequest) -> None:
        """A conversation's next turn: after its think time, under the concurrency cap."""
        await _wait(self.halt, sample.conversation.think_time)
        if self.halt.event.is_set() or not await _acquire(self.sem, self.halt):
            return
        index, self.next_index = self.next_index, self.next_index + 1
        self.launched.append((index, sample))
        self.in_flight += 1
        await self.one(index, sample, time.perf_counter() - self.origin)

    async def one(self, index: int, sample: SampleRequest, offset: float) -> RequestRecord:
        try:
            record = await send_request(self.client, self.backend, self.settings, sample,
                                        index, self.origin)
        finally:
            self.in_flight -= 1
            if self.sem is not None:
                self.sem.release()
        self.watch(lambda now, n=self.in_flight: self.watcher.finished(now, record, n))
        record.scheduled = offset
        self.refusals = self.refusals + 1 if record.error_kind == "connect" else 0
        if self.refusals >= DOWN_AFTER_REFUSALS:
            self.halt.down(f"{self.refusals} connections refused in a row ({record.error})")
        elif self.alive is not None and not self.alive():
            self.halt.down("the server process exited")
        self.records.append(record)
        if sample.conversation is not None and not self.halt.event.is_set():
            nxt = sample.conversation.follow_up(sample, record)
            if nxt is not None:
                self.follow_ups.append(asyncio.ensure_future(self.follow_up(nxt)))
        if self.progress:
            self.progress(len(self.records), self.total or len(self.records))
        return record


def _record_unsent(records: list[RequestRecord], launched: list[tuple[int, SampleRequest]],
                   pending: list[tuple[int, SampleRequest]], plan: RunPlan, halt: Halt) -> int:
    """Failed records for the requests cancelled before they ran and, when the target
    went down, for those never sent; returns how many were never sent."""
    seen = {r.index for r in records}
    for index, sample in launched:  # cancelled before its coroutine ever ran
        if index not in seen:
            records.append(RequestRecord(index, sample.prompt_len, sample.output_len,
                                         error="cancelled before completion",
                                         error_kind="cancelled"))
    for r in records:
        if r.error_kind == "cancelled":
            r.error = f"cancelled before completion ({halt.cancel_note})"
    not_sent = 0
    if halt.target_down and not halt.interrupted and plan.duration is None:
        for index, sample in pending:
            records.append(RequestRecord(
                index, sample.prompt_len, sample.output_len,
                error=f"not sent: the target went down ({halt.target_down})",
                error_kind="not_sent"))
            not_sent += 1
    return not_sent


async def _warmup(client, plan: RunPlan, backend: Backend, settings: RequestSettings,
                  sem: asyncio.Semaphore | None) -> int:
    """Requests before the measurement (connection set-up, lazy init, caches).

    The initial check sends the first prompt once and stops the run if it fails: a wrong
    model name or endpoint should be one clear error, not N failed records. It also
    takes the client's first-request costs (lazy imports, the first connection) out of
    the first measured TTFTs.
    """
    if plan.initial_check and plan.samples:
        probe_record = await send_request(client, backend, settings, plan.samples[0], -1,
                                          time.perf_counter())
        if not probe_record.success:
            raise LlmctlError(f"the initial test request failed: {probe_record.error}",
                              "check --model/--served-model-name, --backend/--endpoint and "
                              "the server's log; the benchmark was not started")
    if plan.warmup <= 0:
        return 0

    async def one(i: int) -> RequestRecord:
        if sem is not None:
            await sem.acquire()
        try:
            sample = plan.samples[i % len(plan.samples)]
            return await send_request(client, backend, settings, sample, -1 - i,
                                      time.perf_counter())
        finally:
            if sem is not None:
                sem.release()

    results = await asyncio.gather(*(one(i) for i in range(plan.warmup)))
    return sum(not r.success for r in results)


async def _sample_metrics(client, base_url: str, interval: float,
                         seen: Callable[[dict], None]) -> list[dict]:
    samples: list[dict] = []
    try:
        while True:
            await asyncio.sleep(interval)
            values = await server_metrics.scrape(client, base_url)
            if values is not None:
                samples.append(values)
                seen(values)
    except asyncio.CancelledError:
        return samples


def fill_output_tokens(records: Iterable[RequestRecord],
                       count: Callable[[str], int] | None) -> None:
    """Output tokens: the server's usage if given, else re-tokenised text, else chunks."""
    for r in records:
        if not r.success or r.output_tokens is not None:
            continue
        if count is not None:
            r.output_tokens, r.output_tokens_source = count(r.text), "tokenizer"
        else:
            r.output_tokens = (len(r.itl) + 1) if r.ttft is not None else 0
            r.output_tokens_source = "chunks"


def run_sync(plan: RunPlan, backend: Backend, settings: RequestSettings, *,
             alive: Callable[[], bool] | None = None,
             progress: Callable[[int, int], None] | None = None,
             watcher: Watcher | None = None) -> RunResult:
    """``run`` on a fresh event loop, with Ctrl-C turned into a partial result."""

    async def main() -> RunResult:
        halt = Halt()
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGINT, _once(loop, halt))
            installed = True
        except (NotImplementedError, RuntimeError, ValueError):
            installed = False  # not the main thread: Ctrl-C stays a KeyboardInterrupt
        try:
            return await run(plan, backend, settings, halt=halt, alive=alive,
                             progress=progress, watcher=watcher)
        finally:
            if installed:
                loop.remove_signal_handler(signal.SIGINT)

    return asyncio.run(main())


def _once(loop: asyncio.AbstractEventLoop, halt: Halt) -> Callable[[], None]:
    def handler() -> None:
        halt.interrupt()
        loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C aborts outright
    return handler
