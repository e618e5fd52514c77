"""The engine's output side: the live requests, their ``RequestOutput`` snapshots, and
their retirement once finished.

A step hands over the sequences whose tokens changed; each of their requests gets one
:class:`~llmctl.serve.engine.outputs.RequestOutput` with what changed since its previous
output (``new_token_ids``, ``text_delta``) and everything so far. A finished request
leaves the table and is counted (finished requests, cached prompt tokens, and the
output fraction deadline admission predicts with).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from llmctl.serve.core.admission import RateMeter
from llmctl.serve.core.sequence import Request, Sequence
from llmctl.serve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmctl.serve.engine.stats import EngineCounters


class OutputProcessor:
    """Owns the live requests (by id) from their admission to their last output."""

    def __init__(self, counters: EngineCounters, rate_meter: RateMeter,
                 forget: Callable[[str], None]) -> None:
        self.requests: dict[str, Request] = {}
        self._counters = counters
        self._rate_meter = rate_meter
        self._forget = forget  # the id may be used again (the engine's inbox)

    def step_outputs(self, touched: dict[str, list[Sequence]],
                     guard: Callable[[Request], AbstractContextManager]
                     ) -> list[RequestOutput]:
        """One output per request with changed sequences (``touched``, by request id),
        each built under ``guard`` (a failure fails that request alone); a failed request
        gets its output at the end of the step instead."""
        outputs = []
        for req_id, seqs in touched.items():
            request = self.requests[req_id]
            if request.error is not None:
                continue
            with guard(request):
                out = self.output(request, seqs)
                outputs.append(out)
                if request.finished:
                    self.retire(request)
        return outputs

    def retire(self, request: Request) -> None:
        """A request has had its last output: count it and forget it."""
        request.finish_time = time.time()
        # an embedding generates nothing: it would teach admission that outputs are empty
        if request.pooled is None and all(s.finish_reason in ("stop", "length")
                                          for s in request.seqs):
            self._rate_meter.record_finish(sum(s.num_output_tokens for s in request.seqs),
                                           request.params.max_tokens * request.params.n)
        self._counters.num_requests_finished += 1
        self._counters.cached_prompt_tokens += request.seqs[0].num_cached_tokens
        self.requests.pop(request.request_id, None)
        self._forget(request.request_id)

    @staticmethod
    def output(request: Request, changed: list[Sequence]) -> RequestOutput:
        """The request's snapshot; ``changed`` sequences' deltas are taken (and marked
        emitted), the others' are empty."""
        outputs = []
        for seq in request.seqs:
            out_ids = seq.output_token_ids
            # a failed request's detokenizer may be what failed: its text is not read
            text = seq.detok.visible_text if request.error is None else ""
            outputs.append(CompletionOutput(
                index=seq.index, token_ids=list(out_ids), text=text,
                new_token_ids=[], text_delta="", finish_reason=seq.finish_reason,
                stop_reason=seq._stop_reason,
                logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None))
        for seq in changed:
            out = outputs[request.seqs.index(seq)]
            out.text_delta = seq.detok.delta()
            out.new_token_ids = out.token_ids[seq.num_emitted:]
            seq.num_emitted = len(out.token_ids)
        prompt_lps = request.prompt_logprobs
        pooled = request.pooled
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids, outputs=outputs,
            finished=request.finished, error=request.error,
            prompt_logprobs=None if prompt_lps is None else list(prompt_lps),
            metrics=RequestMetrics(
                arrival_time=request.arrival_time,
                first_scheduled_time=request.first_scheduled_time,
                first_token_time=min((s.first_token_time for s in request.seqs
                                      if s.first_token_time is not None), default=None),
                finish_time=time.time() if request.finished else None,
                num_cached_tokens=request.seqs[0].num_cached_tokens,
                prefill_chunks=request.prefill_chunks,
                preemption_times=request.preemption_times),
            tenant=request.tenant, priority_class=request.priority_class,
            embedding=pooled.vector() if pooled is not None and pooled.complete
            and request.error is None else None)
