"""Failure isolation: one request never hurts another.

1. What can be checked is checked in ``LLMEngine.add_request``, in the caller, which gets
   the exception (the request never enters the engine). That includes making the first
   sequence's constraint from its factory.
2. Per-request work in ``step()`` (a sequence's detokenizer, constraint updates, the
   forks of an ``n > 1`` request, prompt log-probs, building its output) runs under
   :meth:`FailureIsolation.guard`: an exception fails that request only.
3. Batched work (the model pass, sampling with its constraint masks and seeded draws,
   draft verification, draft proposals) that raises is run again one sequence at a time
   (:meth:`FailureIsolation.isolated`), seeded generators put back first so each draws
   what it would have drawn in the batch; a sequence that raises alone fails its
   request, the others keep their solo results and the step goes on. Repeating the
   model pass is safe: it writes only the KV slots of the tokens it computes, and
   sequences advance only after it. A proposal that fails alone only costs its sequence
   the drafts (it decodes without them, exactly).
4. A failed request ends at the end of the step (:meth:`FailureIsolation.take_failed`,
   then the engine): its unfinished sequences finish with reason "error", its blocks
   are freed without entering the prefix cache, and its final ``RequestOutput`` carries
   ``error`` (the exception, as text).
5. An exception that escapes ``step()`` is the engine's own fault (scheduler or block
   bookkeeping), not a request's: its state can no longer be trusted, and the caller
   should stop stepping it (the server turns unhealthy and ends every stream).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from llmctl.serve.core.sequence import Request, Sequence
from llmctl.serve.sample.sampler import generator_snapshot

log = logging.getLogger("llmctl.serve")


class FailureIsolation:
    """The requests that failed in the current step, and the ways work fails them."""

    def __init__(self) -> None:
        self._failed: list[Request] = []

    @contextlib.contextmanager
    def guard(self, request: Request) -> Iterator[None]:
        """Per-request work: an exception in the block fails ``request`` alone."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - whatever it was, it was this request's
            self.fail(request, exc)

    def fail(self, request: Request, exc: BaseException) -> None:
        if request.error is not None:
            return
        log.error("request %r failed: %s: %s", request.request_id, type(exc).__name__, exc,
                  exc_info=exc)
        request.error = f"{type(exc).__name__}: {exc}"
        self._failed.append(request)

    def take_failed(self) -> list[Request]:
        """The requests failed since the last call (the engine ends them)."""
        failed, self._failed = self._failed, []
        return failed

    def isolated(self, fn: Callable[[list], list], units: list, seqs: list[Sequence],
                 on_fail: Callable[[Sequence, BaseException], None] | None = None) -> list:
        """``fn(units)``: batched work with one result per unit (``seqs[i]`` owns
        ``units[i]``). If it raises, each unit runs alone, with the seeded generators put
        back first so a unit draws what the batch would have drawn for it; a unit that
        raises alone gets ``on_fail`` (default: its request fails) and the result None."""
        on_fail = on_fail or (lambda seq, exc: self.fail(seq.request, exc))
        restore = generator_snapshot(seqs)
        try:
            return fn(units)
        except Exception as exc:  # noqa: BLE001 - attributed below
            if len(units) == 1:
                on_fail(seqs[0], exc)
                return [None]
            log.warning("a batch of %d failed (%s: %s); running each alone to find the cause",
                        len(units), type(exc).__name__, exc)
        restore()
        results = []
        for unit, seq in zip(units, seqs):
            try:
                results.append(fn([unit])[0])
            except Exception as exc:  # noqa: BLE001 - this unit's own failure
                on_fail(seq, exc)
                results.append(None)
        return results
