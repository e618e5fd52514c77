"""Which engine replica gets a request: prefix affinity, held in check by load (pure: no
processes, no threads, a clock passed in).

A request costs ``tokens``, the work it adds (prompt plus max output). A replica's
*outstanding* load ``L`` is the sum of what its unfinished requests still have to compute:
their ``tokens``, lowered by :meth:`Router.progress` reports. :meth:`Router.pick`:

1. Candidates: replicas that are up (the supervisor's word, :meth:`Router.set_up`) and
   whose :class:`~llmctl.serve.proc.breaker.CircuitBreaker` lets a request through
   (closed, or half-open with its one probe not yet out). If the breakers eject every
   replica that is up, those are the candidates all the same: ejection moves load to
   healthier replicas, it never refuses work a live replica can take (Envoy's
   ``max_ejection_percent`` keeps part of a pool in service for the same reason), so
   failing requests -- a client's own bad ones included -- cannot turn the server away
   from everybody. No replica up at all: :class:`NoReplicaError`.
2. Affinity. Prompts that share their first blocks (a system prompt, a conversation's
   history) are cheaper on the replica that already holds those blocks in its prefix
   cache, and a prefix cache hits whole blocks only. So the key is the first
   ``k = min(affinity_blocks, len(prompt) // block_size)`` whole blocks (no key if
   ``k == 0``). If the key was last routed to a candidate ``a``, the request goes to ``a``
   unless ``a`` is overloaded::

       L_a - min(L) > affinity_slack * mean(L) + tokens

   over the candidates, before this request is added. The mean term lets the imbalance
   affinity may cause grow with the load (half a typical replica's queue by default); the
   ``tokens`` term lets it put one request's worth on a nearly idle pool, where the mean
   is near 0, so a conversation's second turn still follows its first while the first
   is running.
3. Otherwise the least outstanding candidate (ties: the lowest index), and the key now
   maps to it. The key map is an LRU of ``max_affinity_entries``: a replica's prefix cache
   evicts old blocks too, so an old key is worth little.

Prior art: SGLang's router (``sgl-router``, ``cache_aware`` policy) follows the longest
prefix match in a radix tree of what it sent each worker unless the pool is imbalanced
(``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold * min``), then
takes the shortest queue; the vLLM production stack's load-aware routing scores
``matched/prompt - beta * (load - mean) / max(1, mean)``. Here the match is one
fixed-length key (no tree: a replica is chosen per key, not per longest match), the load is
in tokens rather than requests, and only the affinity replica is tested, against the
least-loaded one with a slack relative to the mean.

When a replica goes down its affinity is dropped (its cache died with the process) and its
breaker forced open. The requests recorded on it stay until :meth:`Router.finished`
reports them (the supervisor fails them): their tokens are released once, there.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from llmctl.serve.proc.breaker import BreakerConfig, CircuitBreaker


@dataclass(frozen=True)
class RouterConfig:
    block_size: int = 16  # tokens per KV block: the unit a prefix cache can hit
    affinity_blocks: int = 4  # whole blocks of the prompt that key affinity; 0 turns it off
    affinity_slack: float = 0.5  # fraction of the mean load affinity may add (rule above)
    max_affinity_entries: int = 4096  # LRU bound of the key -> replica map

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 token, got {self.block_size!r}")
        if self.affinity_blocks < 0:
            raise ValueError(f"affinity_blocks must be >= 0 (0 turns affinity off), "
                             f"got {self.affinity_blocks!r}")
        if self.affinity_slack < 0:
            raise ValueError(f"affinity_slack must be >= 0 (0: affinity only within one "
                             f"request's tokens of the least loaded), got {self.affinity_slack!r}")
        if self.max_affinity_entries < 1:
            raise ValueError(f"max_affinity_entries must be >= 1, "
                             f"got {self.max_affinity_entries!r}")


class NoReplicaError(RuntimeError):
    """Every replica is down or ejected; ``retry_after`` seconds (>= 1) until one may be
    tried again (the earliest breaker to half-open)."""

    def __init__(self, retry_after: float) -> None:
        self.retry_after = retry_after
        super().__init__(f"no engine replica can take the request: all are down or ejected "
                         f"after failures; retry in {retry_after:.0f} s")


@dataclass
class _Outstanding:
    replica: int
    tokens: int
    done: int = 0

    @property
    def remaining(self) -> int:
        return self.tokens - self.done


class Router:
    """Routes requests over ``num_replicas`` replicas. Not thread-safe: the API process
    calls it from its event loop only."""

    def __init__(self, num_replicas: int, config: RouterConfig = RouterConfig(),
                 breaker: BreakerConfig = BreakerConfig(),  # noqa: B008 -- frozen
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas!r}")
        self.config = config
        self.breakers = [CircuitBreaker(breaker, clock) for _ in range(num_replicas)]
        self._up = [True] * num_replicas
        self._load = [0] * num_replicas  # sum of remaining tokens of its requests
        self._requests: dict[str, _Outstanding] = {}
        self._affinity: OrderedDict[int, int] = OrderedDict()  # key -> replica, oldest first

    @property
    def num_replicas(self) -> int:
        return len(self.breakers)

    def affinity_key(self, prompt_token_ids: list[int], lora: str | None = None) -> int | None:
        """``lora``: the request's adapter; the same tokens under another adapter share no
        cached blocks (the engines' prefix caches are keyed by adapter too)."""
        blocks = min(self.config.affinity_blocks, len(prompt_token_ids) // self.config.block_size)
        if blocks == 0:
            return None
        # a hash, not the ids, keeps the map small; a collision only misplaces one request
        return hash((lora, tuple(prompt_token_ids[:blocks * self.config.block_size])))

    def pick(self, request_id: str, prompt_token_ids: list[int], tokens: int,
             lora: str | None = None) -> int:
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already routed; finish it first")
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens!r}")
        candidates = [i for i, b in enumerate(self.breakers) if self._up[i] and b.would_allow()]
        if not candidates:  # every live replica ejected: they serve anyway (docstring)
            candidates = [i for i in range(self.num_replicas) if self._up[i]]
        if not candidates:
            wait = min(b.seconds_until_half_open() for b in self.breakers)
            raise NoReplicaError(retry_after=max(1.0, wait))
        key = self.affinity_key(prompt_token_ids, lora)
        chosen = self._affine(key, candidates, tokens)
        if chosen is None:
            chosen = min(candidates, key=lambda i: (self._load[i], i))
        if key is not None:
            self._affinity[key] = chosen
            self._affinity.move_to_end(key)
            while len(self._affinity) > self.config.max_affinity_entries:
                self._affinity.popitem(last=False)
        self.breakers[chosen].allow()  # claims the probe if half-open
        self._requests[request_id] = _Outstanding(chosen, tokens)
        self._load[chosen] += tokens
        return chosen

    def _affine(self, key: int | None, candidates: list[int], tokens: int) -> int | None:
        """The key's replica if it is a candidate and not overloaded, else None."""
        replica = self._affinity.get(key) if key is not None else None
        if replica not in candidates:
            return None
        loads = [self._load[i] for i in candidates]
        mean = sum(loads) / len(loads)
        if self._load[replica] - min(loads) > self.config.affinity_slack * mean + tokens:
            return None
        return replica

    def finished(self, request_id: str, ok: bool) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        self._load[request.replica] -= request.remaining
        breaker = self.breakers[request.replica]
        if ok:
            breaker.record_success()
        else:
            breaker.record_failure()

    def progress(self, request_id: str, tokens_done: int) -> None:
        """``tokens_done``: how many of its tokens the request has computed so far
        (cumulative; a lower report than the last is ignored, the total caps it)."""
        request = self._requests.get(request_id)
        if request is None:
            return
        done = min(request.tokens, max(request.done, tokens_done))
        self._load[request.replica] -= done - request.done
        request.done = done

    def set_up(self, replica: int, up: bool) -> None:
        self._up[replica] = up
        if up:
            self.breakers[replica].record_success()
            return
        self.breakers[replica].force_open()
        for key in [k for k, r in self._affinity.items() if r == replica]:
            del self._affinity[key]

    def outstanding(self, replica: int) -> float:
        return float(self._load[replica])

    def requests_on(self, replica: int) -> list[str]:
        return [rid for rid, r in self._requests.items() if r.replica == replica]

    def snapshot(self) -> list[dict]:
        """Per replica, for /metrics and /health."""
        counts = [0] * self.num_replicas
        for request in self._requests.values():
            counts[request.replica] += 1
        return [{"index": i, "up": self._up[i], "state": b.state.value,
                 "outstanding": float(self._load[i]), "requests": counts[i],
                 "consecutive_failures": b.consecutive_failures,
                 "opened_count": b.opened_count}
                for i, b in enumerate(self.breakers)]
