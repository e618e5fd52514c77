"""The engine interface :class:`~llmctl.serve.engine.async_engine.AsyncEngine` drives, served
by engine processes: crash isolation, restarts, replicas.

``add_request``/``abort_request`` run on the API's event loop and write to a replica's
pipe at once (no hop through the engine thread: a request reaches its engine as soon as
it is checked). ``step()`` runs on AsyncEngine's engine thread and does the supervising:
it waits (50 ms at most) on every replica's pipe and process sentinel, hands on the
outputs that arrived and acts on what happened:

- **death** (SIGKILL, a segfault in a native kernel, the OOM killer, an exception out of
  the engine's step): every request on that replica ends with an error marked
  ``retryable`` (HTTP 503 + Retry-After, or an error event on a stream), the router
  stops sending it work, and it restarts after a backoff (0.5 s doubling to 30 s; reset
  once an engine has stayed up a minute). ``engine_restarts`` counts restarts, from the
  moment the death is known (the restart itself follows the backoff).

A watcher thread blocks on each process's pipe hang-up and sentinel (signs that it has
exited) and marks a dead replica ``gone`` at once, so ``healthy`` (``/health``) turns false without waiting for the next step or
the engine thread's idle poll; the engine thread then handles the death as above.
- **hung step**: a replica with requests that has sent nothing (each step sends its
  outputs) for ``step_timeout`` seconds is SIGKILLed, then handled as a death.
- **``max_rss``**: a replica over it drains (takes nothing new, finishes what it has,
  for at most ``drain_timeout``), then stops and restarts at once.

The server is healthy while at least one replica is up. With one replica a restart
leaves none: new requests get 503 with Retry-After (the last load time, rounded up)
until it is ready again.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import select
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait

from llmctl.errors import ConfigError, UsageError
from llmctl.serve.engine.outputs import RequestOutput
from llmctl.serve.engine.request_checks import check_request
from llmctl.serve.engine.sources import source_for
from llmctl.serve.engine.stats import EngineStats
from llmctl.serve.proc.child import ChildSpec, ReadyInfo
from llmctl.serve.proc.replica import Replica, State
from llmctl.serve.proc.router import NoReplicaError, Router, RouterConfig
from llmctl.serve.proc.stats import merge_stats

log = logging.getLogger("llmctl.serve")

FAULT_ENV = "LLMCTL_ENGINE_FAULT"  # test faults for the first engine (llmctl.serve.proc.child)
_WAIT = 0.05  # seconds step() waits for engine messages before supervising again
_RSS_EVERY = 1.0  # seconds between resident-memory reads


class EngineUnavailableError(RuntimeError):
    """No engine process can take the request now: HTTP 503 with ``retry_after``."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class Supervision:
    """How engine processes are watched and restarted."""

    replicas: int = 1
    step_timeout: float = 60.0  # seconds without a step while busy: the engine is hung
    max_rss: int | None = None  # bytes of resident memory before a drain and restart
    # the engine processes' CPU niceness (0-19). The API process (HTTP, SSE, admission)
    # has little work but a queue of clients behind it; on cores it shares with the
    # engine's compute threads, it must win when both want to run, or a new request
    # waits behind whole steps before it reaches the engine. Measured on 2 shared cores
    # (tenant_contention, one round each): a light tenant's p95 TTFT under a flood of
    # 348 ms at nice 0 vs 178 ms at 10. The engine loses only the API's own CPU time.
    nice: int = 10
    drain_timeout: float = 60.0  # seconds a draining engine gets to finish its requests
    backoff: float = 0.5  # first restart delay; doubles per crash in a row
    max_backoff: float = 30.0
    stable_after: float = 60.0  # seconds up after which the next crash is "first" again

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise UsageError(f"--replicas must be at least 1, not {self.replicas}",
                              "give the number of engine processes, e.g. --replicas 2")
        if self.step_timeout <= 0 or self.drain_timeout <= 0:
            raise UsageError("--engine-step-timeout must be positive",
                              "give seconds, e.g. --engine-step-timeout 60")
        if self.max_rss is not None and self.max_rss <= 0:
            raise UsageError("--max-rss must be positive", "give a size, e.g. --max-rss 8GiB")
        if not 0 <= self.nice <= 19:
            raise UsageError(f"--engine-nice must be 0..19, not {self.nice}",
                              "give a niceness, e.g. --engine-nice 10 (0: the API's own)")


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (a container's or taskset's share, not the host's)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def split_cpus(replicas: int, cpus: list[int], threads: int | None
               ) -> list[tuple[tuple[int, ...] | None, int | None]]:
    """(CPUs to pin, threads) per replica: the machine's CPUs in contiguous equal shares
    (two replicas on one core would only take turns), one thread per CPU of the share
    unless ``threads`` (the whole server's) says fewer. One replica keeps the defaults."""
    if replicas == 1:
        return [(None, threads)]
    if replicas > len(cpus):
        raise UsageError(f"--replicas {replicas} needs at least {replicas} CPUs; this process "
                          f"may use {len(cpus)}", f"use --replicas {len(cpus)} or fewer")
    share = len(cpus) // replicas
    per = share if threads is None else max(1, min(share, threads // replicas))
    return [(tuple(cpus[i * share:(i + 1) * share]), per) for i in range(replicas)]


@dataclass
class _Placed:
    replica: int
    prompt_token_ids: list[int]


class _Spec:
    """What AsyncEngine and the API read as ``engine.spec``."""

    def __init__(self, vocab_size: int, hidden_size: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size


class ProcessEngine:
    """Engine processes behind the engine's interface
    (:class:`~llmctl.serve.engine.client.EngineClient`), so :class:`AsyncEngine` drives
    them as it drives an :class:`LLMEngine` in this process."""

    def __init__(self, model: str, engine_kwargs: dict, supervision: Supervision = Supervision(),
                 router: RouterConfig | None = None, log_level: str = "info") -> None:
        self.supervision = supervision
        shares = split_cpus(supervision.replicas, usable_cpus(), engine_kwargs.get("num_threads"))
        fault = os.environ.get(FAULT_ENV) or None
        source = source_for(model)  # cheap (a stat, a manifest): the child opens with it
        self.replicas = [
            Replica(i, ChildSpec(model=model, engine_kwargs={**engine_kwargs, "num_threads": n},
                                 source=source, replica=i, cpus=share, fault=fault,
                                 log_level=log_level, nice=supervision.nice))
            for i, (share, n) in enumerate(shares)]
        block_size = int(engine_kwargs.get("block_size") or 16)
        self.router = Router(len(self.replicas), router or RouterConfig(block_size=block_size))
        # LoRA adapters every replica holds (name -> path): each replica starts with them
        # (its ChildSpec is updated on each load/unload) and gets each change by pipe
        self._loras: dict[str, str] = dict(engine_kwargs.get("loras") or {})
        self.info: ReadyInfo | None = None
        self.restarts = 0
        self._generation = [0] * len(self.replicas)
        self._backoff = [supervision.backoff] * len(self.replicas)
        self._restart_at: list[float | None] = [None] * len(self.replicas)
        self._drain_since: list[float | None] = [None] * len(self.replicas)
        self._load_seconds = 5.0
        # request -> replica, and the router: written by the API's event loop (add) and
        # the engine thread (outputs, deaths); this lock keeps them consistent
        self._lock = threading.Lock()
        self._requests: dict[str, _Placed] = {}
        self._next_rss = 0.0
        self._closing = False
        self._watch_wake_r, self._watch_wake_w = os.pipe()  # new sentinels to watch
        self._watcher = threading.Thread(target=self._watch, name="llmctl-engine-watch",
                                         daemon=True)

    # --- start and stop -----------------------------------------------------------------
    def start(self, timeout: float = 900.0) -> ProcessEngine:
        """Launch every replica and wait until all are ready; a replica's startup error
        (a bad model path, an invalid option) is raised here, as the in-process engine
        would raise it."""
        for replica in self.replicas:
            replica.start(0)
        deadline = time.monotonic() + timeout
        try:
            while any(r.state is State.STARTING for r in self.replicas):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ConfigError(f"the engine did not load within {timeout:g} s",
                                      "check the model path and the engine's log")
                self._wait(min(left, 1.0))
                for replica in self.replicas:
                    messages, eof = replica.receive()
                    for message in messages:
                        if message[0] == "startup_error":
                            raise message[1]
                        if message[0] == "ready":
                            self._ready(replica, message[1])
                    if eof and replica.state is State.STARTING:
                        raise ConfigError(f"the engine process exited while loading "
                                          f"({replica.exit_cause()})", "see its log above")
        except BaseException:
            self.close()
            raise
        self._watcher.start()
        return self

    def close(self) -> None:
        self._closing = True  # stops are not deaths
        self._wake_watcher()
        for replica in self.replicas:
            replica.stop()
        if self._watcher.is_alive():
            self._watcher.join(2.0)
        for fd in (self._watch_wake_r, self._watch_wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._watch_wake_r = self._watch_wake_w = -1

    # --- the death watcher (its own thread) -------------------------------------------
    def _watch(self) -> None:
        """Wait for any engine process to exit, without reading its pipe: a hang-up on
        the pipe (``POLLRDHUP``: the kernel closed the child's end as it exited, before
        its parent is even told) or its sentinel (the forkserver's report of the exit
        status, a process hop later: under CPU contention ~0.5 s later)."""
        hangup = getattr(select, "POLLRDHUP", 0) | select.POLLHUP
        while not self._closing:
            poller = select.poll()
            watched: dict[int, tuple[Replica, object]] = {}
            with self._lock:  # a restart replaces a replica's process and pipe under it
                for r in self.replicas:
                    if r.process is None or r.gone or r.state is State.STOPPED:
                        continue
                    fds = [(r.process.sentinel, select.POLLIN)]
                    if r.conn is not None:  # only hang-ups: its data is the engine thread's
                        fds.append((r.conn.fileno(), hangup))
                    for fd, mask in fds:
                        poller.register(fd, mask)
                        watched[fd] = (r, r.process)
            poller.register(self._watch_wake_r, select.POLLIN)
            try:
                events = poller.poll(1000)
            except (OSError, ValueError):  # closed under us: shutting down
                return
            for fd, mask in events:
                if fd == self._watch_wake_r:
                    try:
                        os.read(self._watch_wake_r, 512)
                    except OSError:
                        return
                    continue
                if mask & select.POLLNVAL or fd not in watched:
                    continue  # closed by the engine thread meanwhile: it saw the death
                replica, process = watched[fd]
                with self._lock:
                    if not self._closing and replica.process is process:
                        self._died(replica)

    def _wake_watcher(self) -> None:
        try:
            os.write(self._watch_wake_w, b"x")
        except OSError:
            pass

    def _died(self, replica: Replica) -> None:
        """Under ``_lock``: the replica's process is known to have exited (first sign,
        from the watcher or the engine thread): unhealthy now, and one restart counted."""
        if not replica.gone:
            replica.gone = True
            self.restarts += 1

    # --- what the API reads ----------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.info.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def spec(self) -> _Spec:
        return _Spec(self.info.vocab_size, self.info.hidden_size)

    @property
    def model_dir(self) -> str | None:
        """The model's directory in the engine processes (its pooling config, if any)."""
        return self.info.model_dir

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def aliases(self) -> tuple[str, ...]:
        return self.info.aliases

    @property
    def healthy(self) -> bool:
        return any(r.state is State.UP and not r.gone for r in self.replicas)

    @property
    def retry_after(self) -> int:
        return max(1, math.ceil(self._load_seconds))

    def admission_key(self, priority: int, priority_class: str | None) -> tuple:
        policy = self.info.policy
        return (priority,) if policy is None else policy.admission_key(priority, priority_class)

    def queue_key(self, priority_class: str | None) -> tuple:
        policy = self.info.policy
        return () if policy is None else policy.queue_key(priority_class)

    def wait_bound(self, priority_class: str | None) -> float | None:
        policy = self.info.policy
        return None if policy is None else policy.wait_bound(priority_class)

    def stats(self) -> EngineStats:
        merged = merge_stats([r.stats for r in self.replicas if r.state is State.UP])
        return dataclasses.replace(
            merged, engine_restarts=self.restarts,
            engine_replicas_up=sum(r.state is State.UP and not r.gone for r in self.replicas))

    # --- requests in (the API's event loop) ---------------------------------------------
    def add_request(self, request_id: str, prompt: list[int], params, *, priority: int = 0,
                    arrival_time: float | None = None, tenant: str | None = None,
                    priority_class: str | None = None, deadline: float | None = None,
                    lora: str | None = None) -> None:
        ids = [int(t) for t in prompt]
        params = check_request(request_id, ids, params, vocab_size=self.info.vocab_size,
                               max_model_len=self.info.max_model_len,
                               prompt_logprobs=self.info.prompt_logprobs,
                               pooling=self.info.pooling)
        kwargs = {"priority": priority, "arrival_time": arrival_time, "tenant": tenant,
                  "priority_class": priority_class, "deadline": deadline, "lora": lora}
        tokens = len(ids) + params.max_tokens * params.n
        with self._lock:
            if request_id in self._requests:
                raise UsageError(f"request id {request_id!r} is already in use",
                                 "give every request a unique id")
            if lora is not None and lora not in self._loras:
                from llmctl.serve.lora.adapter import LoRANotFoundError

                raise LoRANotFoundError(f"no LoRA adapter named {lora!r} is loaded",
                                        f"loaded: {', '.join(self._loras) or 'none'}")
            while True:
                try:
                    index = self.router.pick(request_id, ids, tokens, lora)
                except NoReplicaError as exc:
                    raise EngineUnavailableError(
                        "no engine is ready (restarting); retry shortly",
                        max(self.retry_after, math.ceil(exc.retry_after))) from None
                replica = self.replicas[index]
                if not any(p.replica == index for p in self._requests.values()):
                    replica.busy_since = time.monotonic()
                if replica.send(("add", request_id, ids, params, kwargs)):
                    self._requests[request_id] = _Placed(index, ids)
                    return
                # its pipe is closed: the process died a moment ago and step() has not
                # seen it yet; route around it now (step() restarts it)
                self.router.finished(request_id, ok=False)
                self.router.set_up(index, False)

    # --- LoRA adapters (any thread) -------------------------------------------------------
    def lora_names(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._loras)

    def add_lora(self, name: str, path: str) -> None:
        """Check the adapter here (read in full against the model's shapes, so a bad one
        is the caller's error, not a replica's), then load it in every replica. A request
        naming it after this returns reaches a replica after the load (one pipe, in
        order)."""
        from llmctl.serve.lora.adapter import LoRAError, LoRANameError, load_adapter

        info = self.info
        if info.lora_spec is None:
            raise LoRAError("this engine cannot serve LoRA adapters (an engine directory's "
                            "runtime holds its own weights)", "serve the source checkpoint")
        with self._lock:
            if name in self._loras:
                raise LoRANameError(f"a LoRA adapter named {name!r} is already loaded",
                                "unload it first, or pick another name")
        load_adapter(name, path, info.lora_spec, max_rank=info.max_lora_rank)
        with self._lock:
            if name in self._loras:
                raise LoRANameError(f"a LoRA adapter named {name!r} is already loaded",
                                "unload it first, or pick another name")
            self._loras[name] = str(path)
            self._tell_replicas(("load_lora", name, str(path)))

    def remove_lora(self, name: str) -> None:
        from llmctl.serve.lora.adapter import LoRANotFoundError

        with self._lock:
            if self._loras.pop(name, None) is None:
                raise LoRANotFoundError(f"no LoRA adapter named {name!r} is loaded",
                                        f"loaded: {', '.join(self._loras) or 'none'}")
            self._tell_replicas(("unload_lora", name))

    def _tell_replicas(self, message: tuple) -> None:
        """Under ``_lock`` (which also guards restarts): a replica started from now on
        loads the current adapters itself; one running now gets ``message``."""
        for replica in self.replicas:
            kwargs = {**replica.spec.engine_kwargs, "loras": dict(self._loras)}
            replica.spec = dataclasses.replace(replica.spec, engine_kwargs=kwargs)
            if replica.conn is not None:
                replica.send(message)

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            placed = self._requests.get(request_id)
        if placed is not None:
            self.replicas[placed.replica].send(("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or any(
            r.state not in (State.UP, State.STOPPED) or r.exited for r in self.replicas)

    # --- the engine thread -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        with self._lock:
            self._supervise(time.monotonic(), outputs)
        self._wait(_WAIT)
        for replica in self.replicas:
            if replica.conn is None:
                continue
            messages, eof = replica.receive()
            with self._lock:
                for message in messages:
                    self._handle(replica, message, outputs)
                if eof or replica.exited:
                    self._down(replica, outputs)
        return outputs

    def _wait(self, timeout: float) -> None:
        handles = []
        for r in self.replicas:
            if r.conn is not None:
                handles.append(r.conn)
                handles.append(r.process.sentinel)
        if handles:
            wait(handles, timeout)
        else:
            time.sleep(timeout)

    def _handle(self, replica: Replica, message: tuple, outputs: list[RequestOutput]) -> None:
        kind = message[0]
        if kind == "step":
            _, step_outputs, stats = message
            if stats is not None:
                replica.stats = stats
            for out in step_outputs:
                if out.finished:
                    self._requests.pop(out.request_id, None)
                    self.router.finished(out.request_id, ok=out.error is None)
                elif out.outputs:  # its prompt is computed: what is left is its outputs
                    self.router.progress(out.request_id, len(out.prompt_token_ids) + sum(
                        len(c.token_ids) for c in out.outputs))
            outputs.extend(step_outputs)
        elif kind == "rejected":
            _, request_id, reason = message
            placed = self._requests.pop(request_id, None)
            self.router.finished(request_id, ok=True)  # the request's fault, not the engine's
            if placed is not None:
                outputs.append(_failed(request_id, placed, reason, retryable=False))
        elif kind == "ready":
            self._ready(replica, message[1])
        elif kind == "startup_error":  # a restart that cannot load: keep backing off
            log.error("engine %d failed to restart: %s", replica.index, message[1])

    def _ready(self, replica: Replica, info: ReadyInfo) -> None:
        self._load_seconds = replica.mark_ready(info)
        if self.info is None:
            self.info = info
        self.router.set_up(replica.index, True)
        log.info("engine %d ready (pid %d) in %.1f s", replica.index, info.pid,
                 self._load_seconds)

    def _down(self, replica: Replica, outputs: list[RequestOutput]) -> None:
        """The process is gone: end its requests (retryable) and schedule its restart."""
        self._died(replica)
        replica.process.join(1.0)
        cause = replica.death or replica.exit_cause()
        was_up = replica.state in (State.UP, State.DRAINING)
        replica.close_pipe()
        replica.state = State.DOWN
        self.router.set_up(replica.index, False)
        i = replica.index
        lost = [rid for rid, p in self._requests.items() if p.replica == i]
        message = f"the engine process died ({cause}); retry the request"
        for rid in lost:
            placed = self._requests.pop(rid)
            self.router.finished(rid, ok=False)
            outputs.append(_failed(rid, placed, message, retryable=True))
        now = time.monotonic()
        if self._drain_since[i] is not None:  # a planned stop: restart at once
            delay = 0.0
            self._drain_since[i] = None
        else:
            if was_up and now - replica.ready_at > self.supervision.stable_after:
                self._backoff[i] = self.supervision.backoff
            delay = self._backoff[i]
            self._backoff[i] = min(delay * 2, self.supervision.max_backoff)
        self._restart_at[i] = now + delay
        log.error("engine %d (pid %s) %s; %d request(s) ended as retryable; restarting in "
                  "%.1f s", i, replica.pid, cause, len(lost), delay)

    def _supervise(self, now: float, outputs: list[RequestOutput]) -> None:
        sup = self.supervision
        check_rss = sup.max_rss is not None and now >= self._next_rss
        if check_rss:
            self._next_rss = now + _RSS_EVERY
        for replica in self.replicas:
            i = replica.index
            due = self._restart_at[i]
            if replica.state is State.DOWN and due is not None and now >= due:
                self._restart_at[i] = None
                self._generation[i] += 1
                replica.start(self._generation[i])  # counted in restarts at its death
                self._wake_watcher()  # a new sentinel to watch
                continue
            busy = any(p.replica == i for p in self._requests.values())
            if replica.state in (State.UP, State.DRAINING) and busy and \
                    now - max(replica.last_heard, replica.busy_since) > sup.step_timeout:
                replica.death = (f"made no progress for {sup.step_timeout:g} s "
                                 "(--engine-step-timeout): killed")
                replica.kill()
            if replica.state is State.UP and check_rss:
                rss = replica.rss_bytes()
                if rss is not None and rss > sup.max_rss:
                    log.warning("engine %d uses %.0f MiB (--max-rss %.0f MiB): draining to "
                                "restart it", i, rss / 2**20, sup.max_rss / 2**20)
                    replica.state = State.DRAINING
                    self._drain_since[i] = now
                    self.router.set_up(i, False)
            drain = self._drain_since[i]
            if replica.state is State.DRAINING and drain is not None and \
                    (not busy or now - drain > sup.drain_timeout):
                replica.death = "restarted after --max-rss"
                replica.send(("stop",))


def _failed(request_id: str, placed: _Placed, reason: str, retryable: bool) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt=None,
                         prompt_token_ids=placed.prompt_token_ids, outputs=[], finished=True,
                         error=reason, retryable=retryable)
