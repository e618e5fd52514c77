"""Who goes next: the ordering policies the scheduler asks (no blocks, no model, no clock).

The scheduler (:mod:`llmctl.serve.core.scheduler`) owns the resources -- token budget, sequence
slots, KV blocks -- and asks its policy only about order: the fixed order of its running
and waiting lists (:meth:`key`), the order in which to try admitting waiting sequences at
time ``now`` (:meth:`order`), and which running sequences a waiting one may displace
(:meth:`preemptible`). It reports back what each step computed (:meth:`charge`) and when a
sequence enters or leaves the waiting queue (:meth:`enqueue`, :meth:`dequeue`) or ends
(:meth:`release`).

``fcfs`` (the default) is first come, first served after the client's ``priority``
(lower first): the order the scheduler always had. It never preempts for a waiting
sequence.

``fair`` serves tenants (``Request.tenant``; None is one anonymous tenant) of several
classes (``Request.priority_class``; None or a name not in ``classes`` is the default
class). Three rules, in this precedence:

1. Classes are strict. A class's rank is its position in ``classes`` (by default
   interactive 0, standard 1, batch 2); a lower *level* is always tried first.
2. Aging. A waiting request's level is its rank minus one per ``aging_seconds`` waited
   since it arrived (never below 0), so a request of rank r is at the top level after
   at most ``r * aging_seconds``. From then on rule 3 orders it against every other
   top-level request, and a fair queue bounds its wait: while its tenant is waiting,
   another tenant's service can run ahead of its tenant's by at most about twice one
   request's cost (the bound VTC's paper proves for two backlogged clients), so only
   that much, plus its own tenant's earlier requests, goes before it. Aging counts
   from arrival, so a preempted request keeps the age it had.
3. Fair share between the tenants at one level: the Virtual Token Counter (VTC; Sheng
   et al., "Fairness in Serving Large Language Models", OSDI 2024, arXiv:2401.00588).
   Each tenant has a counter of the tokens computed for it, each prompt token costing 1
   and each output token 2 (w_p = 1, w_q = 2 as in the paper's evaluation: an output
   token is the dearer one), divided by the tenant's weight; the tenant with the
   smallest counter goes next.
   A tenant that has nothing waiting and sends a request has its counter lifted to the
   smallest counter among the tenants that are waiting (to the counter of the last
   tenant that left the queue, when nobody waits): an idle tenant banks no credit and a
   new one does not start at zero. So a tenant flooding the queue gets its share, not
   every slot: a light tenant's request waits for at most about one of the flood's.

Within one tenant and level, its requests go by the client's ``priority`` (lower first),
then arrival: ``priority`` orders a tenant's own work and cannot buy share from others.

Preemption for a waiting request (fair only): it may displace running sequences of a
strictly lower *base* class, newest of the lowest class first (as vLLM's priority
scheduling picks ``max(running, key=(priority, arrival))``), and each sequence at most
once. The once keeps aging's promise: without it a batch request that aging admitted
could be pushed back out by every interactive arrival; with it, displaced once, it comes
back already aged and then runs to its end. Aging does not lift the base class here,
so no two requests can displace each other in turn. One exception makes the aging bound
a bound: a *due* request (a lower class's that has waited its whole
``rank * aging_seconds``) that finds no slot may also displace, once each, running
sequences below the top class of tenants served more than its own (a larger VTC
counter), newest first. Fair share already puts it ahead of those tenants; this only
spares it waiting for one of their sequences to end. The counters order the pair, so
two tenants cannot take turns.

Short steps while a higher class is active (fair only): a request waits for the step in
flight and then for its own, and a step's length is mostly its prompt tokens (a step of
``max_num_batched_tokens`` prompt tokens is several decode steps long). So while a class
is *active* -- it has a request waiting, or one arrived in the last
``ACTIVE_SECONDS`` -- sequences of a lower base class get at most ``GUARD_TOKENS``
prompt tokens per step between them, and none while a request of the active class
waits (its own step then carries only the running decodes and the higher class's
prompts), and no new one starts while ``GUARD_SEQS`` of them run (those running finish;
decodes are never held back). A step's decode rows cost time about linearly in rows on a
compute-bound CPU step, so the steps a higher-class request waits for and runs in stay
short. The guard goes by base class, not level: a flood whose requests wait past their
aging bound still runs inside the guard, else its aged requests would make every step
long again. Nobody starves: a due request whose tenant has nothing running inside the
guard goes past it (one per tenant), so every tenant progresses however many of another
tenant's requests are due. The cost falls on the lower classes' throughput, and only
while a higher class is active.

Aging ranks a request for admission; it makes room for one due sequence per tenant, not
for a class. A flood of one class that waits longer than ``aging_seconds`` competes with
the class above it by fair share and inside the guard, so set ``aging_seconds`` above
the queueing you accept for that class (rate limits and deadline admission keep a
flood's queue short).
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from llmctl.serve.core.sequence import Request, Sequence, SequenceStatus

log = logging.getLogger("llmctl.serve")

DEFAULT_CLASSES = ("interactive", "standard", "batch")
DEFAULT_CLASS = "standard"
# VTC's token costs (Sheng et al. 2024: w_p = 1, w_q = 2)
PROMPT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0
_NOBODY = object()  # no tenant has left the queue yet (None is the anonymous tenant)
# fair: a class stays active this long after its last arrival, and lower classes then
# share this many prompt tokens per step (a few decode steps' worth of time on a small
# model). 30 s spans a user's think time between turns: at 5 s, a class sending 0.5
# requests/s found the guard lifted (and a step of a full prompt budget, ~10 decode
# steps long, in flight) for e^-2.5 = 8% of its requests, which is its p95
# (tenant_contention). The guard costs the lower classes a share of their throughput
# (GUARD_SEQS running, GUARD_TOKENS per step), not their progress.
ACTIVE_SECONDS = 30.0
GUARD_TOKENS = 64
GUARD_SEQS = 8  # lower-level sequences running at once while a higher class is active


@dataclass(frozen=True)
class PrefillCap:
    """At most ``tokens`` prompt tokens this step, between the sequences ``applies`` to,
    and no new one admitted while ``seqs`` of them run."""

    applies: Callable[[Sequence], bool]
    tokens: int
    seqs: int = GUARD_SEQS


class SchedulingPolicy(Protocol):
    name: str

    def key(self, seq: Sequence) -> tuple: ...

    def order(self, waiting: list[Sequence], now: float) -> list[Sequence]: ...

    def preemptible(self, head: Sequence, running: list[Sequence],
                    now: float) -> list[Sequence]: ...

    def displaced(self, seq: Sequence) -> None: ...

    def admission_key(self, priority: int, priority_class: str | None) -> tuple: ...

    def queue_key(self, priority_class: str | None) -> tuple: ...

    def wait_bound(self, priority_class: str | None) -> float | None: ...

    def prefill_cap(self, waiting: list[Sequence], running: list[Sequence],
                    now: float) -> PrefillCap | None: ...

    def enqueue(self, seq: Sequence) -> None: ...

    def dequeue(self, seq: Sequence) -> None: ...

    def charge(self, seq: Sequence, first: int, count: int) -> None: ...

    def release(self, seq: Sequence) -> None: ...


class FCFSPolicy:
    """Lower ``priority`` first, then first come, first served; no preemption for waiting
    requests. Stateless: the waiting list, kept sorted by :meth:`key`, is the order."""

    name = "fcfs"

    def key(self, seq: Sequence) -> tuple:
        return seq.sort_key()

    def order(self, waiting: list[Sequence], now: float) -> list[Sequence]:
        return list(waiting)

    def preemptible(self, head: Sequence, running: list[Sequence],
                    now: float) -> list[Sequence]:
        return []

    def displaced(self, seq: Sequence) -> None:
        pass

    def admission_key(self, priority: int, priority_class: str | None) -> tuple:
        return (priority,)

    def queue_key(self, priority_class: str | None) -> tuple:
        """One queue: the limit counts every waiting request (``priority`` is the
        client's to choose, so it cannot buy a queue of its own)."""
        return ()

    def wait_bound(self, priority_class: str | None) -> float | None:
        return None  # a request waits for everything ahead of it

    def prefill_cap(self, waiting: list[Sequence], running: list[Sequence],
                    now: float) -> PrefillCap | None:
        return None

    def enqueue(self, seq: Sequence) -> None:
        pass

    def dequeue(self, seq: Sequence) -> None:
        pass

    def charge(self, seq: Sequence, first: int, count: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass


class FairPolicy:
    """Strict classes with aging, VTC fair share between tenants (module docstring)."""

    name = "fair"

    def __init__(self, classes: tuple[str, ...] = DEFAULT_CLASSES,
                 default_class: str = DEFAULT_CLASS, aging_seconds: float = 30.0,
                 weights: Mapping[str, float] | None = None) -> None:
        if not classes or len(set(classes)) != len(classes):
            raise ValueError(f"priority classes must be distinct and at least one: {classes}")
        if default_class not in classes:
            raise ValueError(f"default class {default_class!r} is not one of {classes}")
        if aging_seconds <= 0:
            raise ValueError("aging_seconds must be positive")
        self.classes = tuple(classes)
        self.ranks = {name: i for i, name in enumerate(classes)}
        self.default_rank = self.ranks[default_class]
        self.aging_seconds = float(aging_seconds)
        self.weights = dict(weights or {})
        self.counters: dict[str | None, float] = {}  # tenant -> weighted tokens served
        self._waiting: dict[str | None, int] = {}  # tenant -> sequences waiting
        self._last_left: object = _NOBODY  # the last tenant whose waiting count hit 0
        self._charged: dict[int, int] = {}  # seq_id -> token positions already charged
        self._displaced: set[int] = set()  # seq_ids once preempted for a waiting request
        self._last_arrival: dict[int, float] = {}  # class rank -> its latest request's arrival
        self._warned: set[str] = set()

    # --- classes and levels --------------------------------------------------------
    def rank(self, priority_class: str | None) -> int:
        if priority_class is None:
            return self.default_rank
        rank = self.ranks.get(priority_class)
        if rank is None:
            if priority_class not in self._warned:
                self._warned.add(priority_class)
                log.warning("unknown priority class %r: scheduled as %r (known: %s)",
                            priority_class, self.classes[self.default_rank],
                            ", ".join(self.classes))
            return self.default_rank
        return rank

    def level(self, request: Request, now: float) -> int:
        """The class rank less one per ``aging_seconds`` waited, at least 0."""
        waited = max(0.0, now - request.arrival_time)
        return max(0, self.rank(request.priority_class) - int(waited // self.aging_seconds))

    def aging_bound(self, priority_class: str | None) -> float:
        """Seconds after which a waiting request of this class is at the top level."""
        return self.rank(priority_class) * self.aging_seconds

    def weight(self, tenant: str | None) -> float:
        return self.weights.get(tenant, 1.0) if tenant is not None else 1.0

    # --- orders --------------------------------------------------------------------
    def key(self, seq: Sequence) -> tuple:
        req = seq.request
        return (self.rank(req.priority_class), req.priority, req.arrival_time, req.serial,
                seq.index)

    def admission_key(self, priority: int, priority_class: str | None) -> tuple:
        return (self.rank(priority_class),)

    def queue_key(self, priority_class: str | None) -> tuple:
        """A queue per class (classes come from the operator's tenant table): a flood of
        one class cannot fill the queue against another."""
        return (self.rank(priority_class),)

    def wait_bound(self, priority_class: str | None) -> float | None:
        """Seconds after which a request of this class goes before every higher class's
        queued work (below the top class, its aging bound: it is then due, passes the
        guard and may displace a running sequence); its own class's work ahead of it still
        goes first. Deadline admission uses it (llmctl.serve.core.admission), or a flood queued
        above a batch request would get it refused although aging lets it in."""
        return self.aging_bound(priority_class) if self.rank(priority_class) > 0 else None

    def due(self, request: Request, now: float) -> bool:
        """A lower class's request that has waited its whole aging bound."""
        return self.rank(request.priority_class) > 0 and self.level(request, now) == 0

    def prefill_cap(self, waiting: list[Sequence], running: list[Sequence],
                    now: float) -> PrefillCap | None:
        """Lower base classes' prompt tokens and sequences while a higher class is active,
        one due sequence per tenant excepted (module docstring)."""
        ranks = [self.rank(seq.request.priority_class) for seq in waiting]
        active = [r for r, t in self._last_arrival.items() if now - t < ACTIVE_SECONDS]
        top = min(ranks + active, default=None)
        if top is None:
            return None
        tokens = 0 if top in ranks else GUARD_TOKENS
        inside = Counter(seq.request.tenant for seq in running
                         if self.rank(seq.request.priority_class) > top)
        # one due sequence per tenant with nothing running inside the guard goes past it:
        # that tenant's first in its own order (a running one keeps the pass while alone)
        firsts: dict[str | None, tuple] = {}
        for seq in waiting:
            req = seq.request
            if (self.rank(req.priority_class) > top and not inside[req.tenant]
                    and self.due(req, now)):
                key = (req.priority, req.arrival_time, req.serial, seq.index, seq.seq_id)
                if req.tenant not in firsts or key < firsts[req.tenant]:
                    firsts[req.tenant] = key
        passes = {key[-1] for key in firsts.values()}

        def applies(seq: Sequence) -> bool:
            req = seq.request
            if self.rank(req.priority_class) <= top:
                return False
            if seq.status is SequenceStatus.RUNNING:
                return not (self.due(req, now) and inside[req.tenant] == 1)
            return seq.seq_id not in passes

        return PrefillCap(applies, tokens)

    def _prompt_cost(self, seq: Sequence) -> float:
        """What admitting ``seq`` will charge its tenant first: its prompt tokens not yet
        charged (a preempted sequence recomputing them pays nothing again)."""
        done = self._charged.get(seq.seq_id, 0)
        return PROMPT_TOKEN_COST * max(0, seq.num_prompt_tokens - done)

    def order(self, waiting: list[Sequence], now: float) -> list[Sequence]:
        """Waiting sequences in the order to try them: each pick is the head of the tenant
        with the smallest (level, counter), its counter then advanced by the prompt the
        pick will be charged, as if the picks before it had been admitted."""
        queues: dict[str | None, list[tuple]] = {}
        for seq in waiting:
            req = seq.request
            queues.setdefault(req.tenant, []).append(
                (self.level(req, now), req.priority, req.arrival_time, req.serial, seq.index,
                 seq))
        heap = []
        for tenant, queue in queues.items():
            queue.sort(key=lambda item: item[:5])
            queue.reverse()  # pop() from the end takes the best
            heap.append(self._entry(tenant, queue[-1], self.counters.get(tenant, 0.0)))
        heapq.heapify(heap)
        projected = {tenant: self.counters.get(tenant, 0.0) for tenant in queues}
        out = []
        while heap:
            entry = heapq.heappop(heap)
            tenant = entry[-1]
            queue = queues[tenant]
            seq = queue.pop()[-1]
            out.append(seq)
            projected[tenant] += self._prompt_cost(seq) / self.weight(tenant)
            if queue:
                heapq.heappush(heap, self._entry(tenant, queue[-1], projected[tenant]))
        return out

    @staticmethod
    def _entry(tenant: str | None, head: tuple, counter: float) -> tuple:
        level, _priority, arrival, serial, index, _seq = head
        # ties on (level, counter): the earlier head, then submission order (unique)
        return (level, counter, arrival, serial, index, tenant)

    def preemptible(self, head: Sequence, running: list[Sequence],
                    now: float) -> list[Sequence]:
        """Running sequences ``head`` may displace, best victim first (``running`` is
        sorted by :meth:`key`), none displaced before: those of a strictly lower base
        class, newest of the lowest class first; then, if ``head`` is due, those below the
        top class of tenants with a larger counter than its tenant's, newest first."""
        def rank(seq: Sequence) -> int:
            return self.rank(seq.request.priority_class)

        fresh = [s for s in reversed(running) if s.seq_id not in self._displaced]
        victims = [s for s in fresh if rank(s) > rank(head)]
        if self.due(head.request, now):
            owed = self.counters.get(head.request.tenant, 0.0)
            victims += [s for s in fresh if 0 < rank(s) <= rank(head)
                        and self.counters.get(s.request.tenant, 0.0) > owed]
        return victims

    def displaced(self, seq: Sequence) -> None:
        """``seq`` was preempted for a waiting request: it will not be again."""
        self._displaced.add(seq.seq_id)

    # --- bookkeeping ---------------------------------------------------------------
    def enqueue(self, seq: Sequence) -> None:
        tenant = seq.request.tenant
        if seq.status is SequenceStatus.WAITING:  # a new request, not a preempted one
            rank = self.rank(seq.request.priority_class)
            self._last_arrival[rank] = max(self._last_arrival.get(rank, 0.0),
                                           seq.request.arrival_time)
        if not self._waiting.get(tenant) and seq.status is SequenceStatus.WAITING:
            # VTC's lift, for a new request only: a preempted one was being served, so
            # its tenant was not idle
            waiting = [self.counters.get(t, 0.0) for t, n in self._waiting.items() if n]
            floor = min(waiting) if waiting else self.counters.get(self._last_left, 0.0)
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        self._waiting[tenant] = self._waiting.get(tenant, 0) + 1

    def dequeue(self, seq: Sequence) -> None:
        tenant = seq.request.tenant
        left = self._waiting.get(tenant, 0) - 1
        if left > 0:
            self._waiting[tenant] = left
        else:
            self._waiting.pop(tenant, None)
            self._last_left = tenant

    def charge(self, seq: Sequence, first: int, count: int) -> None:
        """Token positions ``first .. first + count - 1`` of ``seq`` were computed: charge
        those never charged before (recomputation after a preemption is the scheduler's
        doing, not the tenant's; prefix-cache hits are never computed, so never charged)."""
        done = self._charged.get(seq.seq_id, 0)
        start, end = max(first, done), first + count
        if end <= start:
            return
        prompt = max(0, min(end, seq.num_prompt_tokens) - start)
        cost = PROMPT_TOKEN_COST * prompt + OUTPUT_TOKEN_COST * (end - start - prompt)
        tenant = seq.request.tenant
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.weight(tenant)
        self._charged[seq.seq_id] = end

    def release(self, seq: Sequence) -> None:
        self._charged.pop(seq.seq_id, None)
        self._displaced.discard(seq.seq_id)


POLICIES = {
    "fcfs": lambda config: FCFSPolicy(),
    "fair": lambda config: FairPolicy(tuple(config.priority_classes),
                                      config.default_priority_class, config.aging_seconds,
                                      config.tenant_weights),
}


def make_policy(config) -> SchedulingPolicy:
    """The policy an :class:`~llmctl.serve.engine.config.EngineConfig` names."""
    return POLICIES[config.scheduling_policy](config)
