"""The engine process: build the engine, then step it and answer its parent's pipe.

Wire protocol (one :class:`multiprocessing.connection.Connection`, pickled tuples):

parent -> child
    ``("add", request_id, prompt_token_ids, params, kwargs)``  kwargs of ``add_request``
    ``("abort", request_id)``
    ``("load_lora", name, path)``                   LLMEngine.add_lora (the parent has
                                                    checked the adapter: a failure is logged)
    ``("unload_lora", name)``                       LLMEngine.remove_lora
    ``("stop",)``                                   finish the step, exit 0
child -> parent
    ``("ready", ReadyInfo)``                         once, after the model loaded
    ``("startup_error", exception)``                 instead of ready; then exit 1
    ``("step", outputs, stats | None)``              after every step (the heartbeat);
                                                     stats every 0.1 s and when idle
    ``("rejected", request_id, message)``            add_request refused it here

The child never outlives its parent: a closed pipe (the parent exited or was killed)
ends the loop. It ignores SIGINT, which a terminal's Ctrl-C sends to the whole process
group, and SIGTERM, which a service manager sends to every process of the service: the
parent decides when the engine stops (a graceful shutdown drains first).

Faults for tests (``ChildSpec.fault``, from ``$LLMCTL_ENGINE_FAULT`` in the parent),
applied by the first generation of replica 0 only so a restarted engine is healthy:
``hang@N`` stops stepping after step N (the supervisor's hung-step detection),
``crash@N`` SIGKILLs itself after step N, ``grow@N`` keeps N MiB more per step (the
``--max-rss`` drain).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("llmctl.serve.engine")

STATS_EVERY = 0.1  # seconds between stats sent while busy (stats() walks the batch)
IDLE_POLL = 1.0  # seconds an idle child blocks on its pipe between liveness checks


@dataclass(frozen=True)
class ChildSpec:
    """What one engine process is started with (pickled to it)."""

    model: str
    engine_kwargs: dict[str, Any]
    # the model source that claimed MODEL in the parent (llmctl.serve.engine.sources), pickled by
    # reference to its class: the child opens MODEL with it, so sources registered by
    # packages above this one (engine directories) work without this layer importing them
    source: Any = None
    replica: int = 0
    generation: int = 0  # restarts of this replica so far
    cpus: tuple[int, ...] | None = None  # pin to these CPUs (replicas split the machine)
    fault: str | None = None
    log_level: str = "info"
    nice: int = 0  # added to the process's niceness (Supervision.nice) before any thread


@dataclass(frozen=True)
class ReadyInfo:
    """What the API process needs of the engine, sent once after the load."""

    name: str
    aliases: tuple[str, ...]
    tokenizer: Any  # the HF tokenizer, pickled across
    vocab_size: int
    max_model_len: int
    prompt_logprobs: bool  # the runner can return prompt log-probs
    policy: Any  # a fresh copy of the scheduling policy: admission keys in the parent
    # the model's ModelSpec, for checking LoRA adapters in the parent; None: the engine
    # cannot serve adapters (an engine directory)
    lora_spec: Any = None
    max_lora_rank: int = 0
    pooling: bool = False  # the runner can return embeddings (Target.serves_pooling)
    hidden_size: int | None = None  # the embeddings' size
    model_dir: str | None = None  # the model's directory (its pooling config, if any)
    pid: int = field(default_factory=os.getpid)


class _Fault:
    """A test fault (module docstring): what to do after each step."""

    def __init__(self, text: str | None) -> None:
        self.kind, self.at = None, 0
        if text:
            kind, _, arg = text.partition("@")
            if kind not in ("hang", "crash", "grow") or not arg.isdigit():
                raise ValueError(f"unknown engine fault {text!r} (hang@N, crash@N, grow@MiB)")
            self.kind, self.at = kind, int(arg)
        self._kept: list[bytearray] = []

    def after_step(self, step: int) -> None:
        if self.kind == "hang" and step >= self.at:
            while True:  # a step that never returns; the supervisor must kill us
                time.sleep(3600)
        if self.kind == "crash" and step >= self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "grow":
            self._kept.append(bytearray(self.at << 20))  # zero-filled: resident at once


def _setup(spec: ChildSpec) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # see forkserver_init (spawn: set here)
    logging.basicConfig(level=spec.log_level.upper(),
                        format=f"%(levelname)s %(name)s[engine {spec.replica}]: %(message)s")
    if spec.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, spec.cpus)
    if spec.nice and hasattr(os, "nice"):
        # per thread on Linux: before torch starts its pool, whose threads inherit it
        os.nice(spec.nice)


def _open(spec: ChildSpec):
    from llmctl.serve.engine.sources import source_for

    source = spec.source if spec.source is not None else source_for(spec.model)
    opened = source.open(spec.model, spec.engine_kwargs)
    engine = opened.engine
    try:  # response_format grammars arrive as text; this process compiles its own
        from llmctl.serve.sample.grammar import GrammarFactory, install_process_factory

        vocab = max(len(engine.tokenizer), engine.spec.vocab_size)
        install_process_factory(GrammarFactory(engine.tokenizer, vocab))
    except Exception as exc:  # noqa: BLE001 - structured output is optional (as in launch)
        log.warning("response_format disabled: %s", exc)
    policy = getattr(getattr(engine, "scheduler", None), "policy", None)
    loras = getattr(engine, "loras", None) is not None
    info = ReadyInfo(name=opened.name, aliases=tuple(opened.aliases),
                     tokenizer=engine.tokenizer, vocab_size=engine.spec.vocab_size,
                     max_model_len=engine.max_model_len,
                     prompt_logprobs=hasattr(engine.runner, "execute_with_prompt"),
                     policy=policy, lora_spec=engine.spec if loras else None,
                     max_lora_rank=engine.config.max_lora_rank if loras else 0,
                     pooling=getattr(getattr(engine, "target", None), "serves_pooling", False),
                     hidden_size=getattr(engine.spec, "hidden_size", None),
                     model_dir=str(getattr(getattr(engine, "target", None), "path", "")) or None)
    return engine, info


def main(conn, spec: ChildSpec) -> None:
    """The process target: never raises (a startup error goes to the parent)."""
    _setup(spec)
    try:
        fault = _Fault(spec.fault if spec.replica == 0 and spec.generation == 0 else None)
        engine, info = _open(spec)
    except BaseException as exc:  # noqa: BLE001 - the parent shows it and exits
        try:
            conn.send(("startup_error", exc))
        except Exception:  # noqa: BLE001 - an unpicklable exception: send its text
            conn.send(("startup_error", RuntimeError(f"{type(exc).__name__}: {exc}")))
        raise SystemExit(1) from None
    conn.send(("ready", info))
    try:
        _serve(conn, engine, fault)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent is gone: nothing to answer to


def _update_loras(engine, message: tuple) -> None:
    try:
        if message[0] == "load_lora":
            engine.add_lora(message[1], message[2])
        else:
            engine.remove_lora(message[1])
    except Exception as exc:  # noqa: BLE001 - the parent checked it; requests naming it fail
        log.error("%s %r failed: %s", message[0], message[1], exc)


def _serve(conn, engine, fault: _Fault) -> None:
    steps = 0
    last_stats = 0.0
    while True:
        if not engine.has_unfinished_requests() and not conn.poll(IDLE_POLL):
            continue
        while conn.poll():
            message = conn.recv()
            kind = message[0]
            if kind == "add":
                _, request_id, prompt, params, kwargs = message
                try:
                    engine.add_request(request_id, prompt, params, **kwargs)
                except Exception as exc:  # noqa: BLE001 - the parent checked; say why not
                    conn.send(("rejected", request_id, str(exc)))
            elif kind == "abort":
                engine.abort_request(message[1])
            elif kind in ("load_lora", "unload_lora"):
                _update_loras(engine, message)
            elif kind == "stop":
                return
        if not engine.has_unfinished_requests():
            continue
        outputs = engine.step()  # an exception here is an engine fault: the process dies
        steps += 1
        now = time.monotonic()
        stats = None
        # the step that empties the engine always carries its stats: a client reading
        # /metrics right after its last response sees every token counted
        if now - last_stats > STATS_EVERY or not engine.has_unfinished_requests():
            stats, last_stats = engine.stats(), now
        conn.send(("step", outputs, stats))
        fault.after_step(steps)
