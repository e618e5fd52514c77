"""OpenTelemetry traces of requests: ``llmctl serve --otlp-traces-endpoint URL``.

Off by default, and then free: nothing imports the OpenTelemetry SDK, and the request
path pays one ``is None`` test per request and per output (:class:`~llmctl.serve.api.
handler.RequestHandler`'s ``tracing``).

On, every HTTP request gets one SERVER span named ``llm_request`` (vLLM's name), a child
of the client's W3C ``traceparent``/``tracestate`` when it sends them (so ``llmctl bench``
records and a gateway's spans join it), otherwise the root of a new trace. It starts when
the request is handed to the engine and ends when its last output has been handled. Its
children are made after the fact, with the times the engine recorded (vLLM does the same):
per engine request (one per prompt) ``queue``, ``prefill`` (divided into one
``prefill_chunk`` per engine step) and ``decode``, laid out by
:func:`llmctl.serve.api.timeline.request_phases`. A request that failed, timed out or
whose client left has ERROR status and the phases it reached.

Attribute names (:class:`Attr`) are vLLM's (``vllm/tracing.py``: the OpenTelemetry GenAI
conventions of its time plus its ``gen_ai.latency.*`` additions), so dashboards built for
vLLM read llmctl's traces; the current conventions' names for token usage
(``gen_ai.usage.input_tokens`` / ``output_tokens``) are set too. llmctl's own additions are
under ``llmctl.``. Spans leave through a BatchSpanProcessor (a background thread; the
request path only queues them) to an OTLP/HTTP (protobuf) collector; the exporter also
reads the standard ``OTEL_EXPORTER_OTLP_TRACES_*`` variables (headers, timeout, TLS).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from llmctl.errors import MissingDependencyError, UsageError
from llmctl.serve.api.timeline import Phase, request_phases
from llmctl.serve.openai.errors import APIError

TRACER_NAME = "llmctl.serve"
SPAN_NAME = "llm_request"
# The OTLP/HTTP path for traces (OTLP specification, "OTLP/HTTP Request"): added to an
# endpoint given without a path, as the SDK does for OTEL_EXPORTER_OTLP_ENDPOINT.
TRACES_PATH = "/v1/traces"
INSTALL_HINT = "install the tracing extra: pip install 'llmctl[tracing]'"


class Attr:
    """Span attribute names."""

    OPERATION = "gen_ai.operation.name"  # "chat" | "text_completion"
    REQUEST_ID = "gen_ai.request.id"
    RESPONSE_MODEL = "gen_ai.response.model"
    MAX_TOKENS = "gen_ai.request.max_tokens"
    TEMPERATURE = "gen_ai.request.temperature"
    TOP_P = "gen_ai.request.top_p"
    N = "gen_ai.request.n"
    PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    INPUT_TOKENS = "gen_ai.usage.input_tokens"
    OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
    NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    FINISH_REASONS = "gen_ai.response.finish_reasons"
    TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"  # seconds, as all latencies here
    TTFT = "gen_ai.latency.time_to_first_token"
    E2E = "gen_ai.latency.e2e"
    PREFILL_TIME = "gen_ai.latency.time_in_model_prefill"
    DECODE_TIME = "gen_ai.latency.time_in_model_decode"
    INFERENCE_TIME = "gen_ai.latency.time_in_model_inference"
    ERROR_TYPE = "error.type"
    HTTP_STATUS = "http.response.status_code"
    TENANT = "llmctl.tenant"
    PRIORITY_CLASS = "llmctl.priority_class"
    PRIORITY = "llmctl.priority"
    NUM_PREEMPTIONS = "llmctl.num_preemptions"
    CACHED_TOKENS = "llmctl.prefix_cache.hit_tokens"
    PREFILL_CHUNKS = "llmctl.prefill.chunks"
    PREFILL_TOKENS = "llmctl.prefill.tokens"  # prompt tokens computed (cache hits excluded)
    CHUNK_INDEX = "llmctl.prefill.chunk_index"


_OPERATIONS = {"chat": "chat", "completion": "text_completion"}
_GONE = (asyncio.CancelledError, GeneratorExit)  # the client left mid-request


def otlp_traces_url(endpoint: str) -> str:
    """The collector URL spans are POSTed to; a usage error names what to pass instead.

    llmctl speaks OTLP over HTTP (protobuf): a gRPC endpoint (scheme grpc, port 4317, as
    vLLM's default gRPC exporter takes) is refused rather than sent bytes it cannot read.
    """
    parts = urlsplit(endpoint)
    example = "e.g. http://localhost:4318/v1/traces"
    try:
        port = parts.port  # ValueError for a port that is not a number in 0..65535
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise UsageError(f"--otlp-traces-endpoint {endpoint!r} is not an http(s) URL",
                         f"pass the collector's OTLP/HTTP URL, {example}")
    if port == 4317:
        raise UsageError(f"--otlp-traces-endpoint {endpoint!r} is OTLP/gRPC's port; llmctl "
                         "exports OTLP over HTTP", f"use the collector's HTTP port, {example}")
    if parts.path in ("", "/"):
        parts = parts._replace(path=TRACES_PATH)
    return urlunsplit(parts)


def setup_tracing(endpoint: str | None, service_name: str = "llmctl", *,
                  exporter: Any = None) -> Tracing | None:
    """The server's tracing, or None (no endpoint: off). ``exporter``: a SpanExporter that
    receives every span synchronously instead of the OTLP one (tests: the SDK's
    InMemorySpanExporter)."""
    if endpoint is None and exporter is None:
        return None
    url = otlp_traces_url(endpoint) if exporter is None else None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as exc:
        raise MissingDependencyError(f"tracing needs the OpenTelemetry SDK ({exc})",
                                     INSTALL_HINT) from None
    # OTEL_SERVICE_NAME, when set, names the service (the SDK reads it in Resource.create)
    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(attrs))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise MissingDependencyError(f"OTLP export needs its exporter package ({exc})",
                                         INSTALL_HINT) from None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    return Tracing(provider, url)


class Tracing:
    """Starts a :class:`RequestTrace` per HTTP request; flushes spans at shutdown."""

    def __init__(self, provider: Any, url: str | None = None) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.url = url
        self.tracer = provider.get_tracer(TRACER_NAME)
        self.api = trace  # opentelemetry.trace, imported only when tracing is on
        self._propagator = TraceContextTextMapPropagator()

    def begin(self, headers: Mapping[str, str], kind: str, req: Any, jobs: Sequence[Any],
              params: Any, model: str) -> RequestTrace:
        """Open the request's span (now) under the client's trace context, if any.
        ``jobs``: the request's engine requests (``request_id``, ``prompt_ids``)."""
        parent = self._propagator.extract(headers) if "traceparent" in headers else None
        rid = jobs[0].request_id.rsplit("-", 1)[0]
        attributes = {
            Attr.OPERATION: _OPERATIONS.get(kind, kind), Attr.REQUEST_ID: rid,
            Attr.RESPONSE_MODEL: model,
            Attr.MAX_TOKENS: params.max_tokens, Attr.TEMPERATURE: params.temperature,
            Attr.TOP_P: params.top_p, Attr.N: params.n,
            Attr.PRIORITY: getattr(req, "priority", 0) or 0}
        span = self.tracer.start_span(SPAN_NAME, context=parent,
                                      kind=self.api.SpanKind.SERVER,
                                      attributes=attributes, start_time=time.time_ns())
        return RequestTrace(self, span, list(jobs), bool(getattr(req, "prompt_only", False)))

    def shutdown(self) -> None:
        """Export what is queued and stop (the OTLP exporter's last batch leaves here)."""
        self.provider.shutdown()


class RequestTrace:
    """One HTTP request's span: sees its engine outputs, closes once with the outcome."""

    def __init__(self, tracing: Tracing, span: Any, jobs: list[Any], prompt_only: bool) -> None:
        self._tracing = tracing
        self.span = span
        self._jobs = jobs
        self._prompt_only = prompt_only  # echo without generation: no completion tokens
        self._last: dict[str, Any] = {}  # engine request id -> its latest RequestOutput
        self._closed = False

    def observe(self, request_id: str, out: Any) -> None:
        self._last[request_id] = out

    def close(self, error: BaseException | None = None) -> None:
        """End the span (now): children from the engine's times, totals, and ERROR status
        when ``error`` (or an engine request that never finished) says it failed."""
        if self._closed:
            return
        self._closed = True
        span = self.span
        end = time.time()
        if span.is_recording():
            unfinished = self._record(end)
            failure = _failure(error) if error is not None else \
                ("an engine request did not finish", "unfinished", None) if unfinished else None
            if failure is not None:
                message, kind, status = failure
                span.set_status(self._tracing.api.Status(
                    self._tracing.api.StatusCode.ERROR, message))
                span.set_attribute(Attr.ERROR_TYPE, kind)
                if status is not None:
                    span.set_attribute(Attr.HTTP_STATUS, status)
        span.end(end_time=_ns(end))

    def _record(self, end: float) -> int:
        """Children and totals onto the span; how many engine requests did not finish."""
        span = self.span
        context = self._tracing.api.set_span_in_context(span)
        outs = [self._last.get(job.request_id) for job in self._jobs]
        seen = [out for out in outs if out is not None]
        for job, out in zip(self._jobs, outs):
            if out is not None:
                self._children(context, job.request_id, out, end)
        completion = 0 if self._prompt_only else \
            sum(len(c.token_ids) for out in seen for c in out.outputs)
        prompt = sum(len(job.prompt_ids) for job in self._jobs)
        span.set_attributes({
            Attr.PROMPT_TOKENS: prompt, Attr.INPUT_TOKENS: prompt,
            Attr.COMPLETION_TOKENS: completion, Attr.OUTPUT_TOKENS: completion,
            Attr.NUM_SEQUENCES: sum(len(out.outputs) for out in seen),
            Attr.FINISH_REASONS: [c.finish_reason or "abort" for out in seen
                                  for c in out.outputs],
            Attr.NUM_PREEMPTIONS: sum(out.metrics.num_preemptions for out in seen),
            Attr.CACHED_TOKENS: sum(out.metrics.num_cached_tokens for out in seen),
            Attr.PREFILL_CHUNKS: sum(len(out.metrics.prefill_chunks) for out in seen)})
        span.set_attributes(_latencies([out.metrics for out in seen], end))
        for name in ("tenant", "priority_class"):
            value = next((getattr(out, name) for out in seen if getattr(out, name, None)),
                         None)
            if value is not None:
                span.set_attribute(getattr(Attr, name.upper()), value)
        return sum(1 for out in outs if out is None or not out.finished)

    def _children(self, context: Any, request_id: str, out: Any, end: float) -> None:
        """The engine request's phases as spans under ``context`` (the request's span)."""
        tracer, api = self._tracing.tracer, self._tracing.api
        spans: dict[str, Any] = {}
        for phase in request_phases(out.metrics, end):
            parent = context if phase.parent is None else \
                api.set_span_in_context(spans[phase.parent])
            child = tracer.start_span(phase.name, context=parent, start_time=_ns(phase.start),
                                      attributes=_phase_attributes(phase, request_id))
            for name, t in phase.events:
                child.add_event(name, timestamp=_ns(t))
            child.end(end_time=_ns(phase.end))  # a span's children may start after its end
            spans[phase.name] = child


def _phase_attributes(phase: Phase, request_id: str) -> dict[str, Any]:
    attrs: dict[str, Any] = {Attr.REQUEST_ID: request_id}
    if phase.tokens is not None:
        attrs[Attr.PREFILL_TOKENS] = phase.tokens
    if phase.index is not None:
        attrs[Attr.CHUNK_INDEX] = phase.index
    return attrs


def _latencies(metrics: list[Any], end: float) -> dict[str, float]:
    """vLLM's latency attributes (seconds) over the request's engine requests: queue time
    is the longest wait, TTFT from the first arrival to the first token, e2e to the last
    finish (or ``end``)."""
    if not metrics:
        return {}
    arrival = min(m.arrival_time for m in metrics)
    out = {Attr.E2E: max((m.finish_time or end) for m in metrics) - arrival}
    scheduled = [m for m in metrics if m.first_scheduled_time is not None]
    if scheduled:
        out[Attr.TIME_IN_QUEUE] = max(m.first_scheduled_time - m.arrival_time for m in scheduled)
    tokens = [m for m in scheduled if m.first_token_time is not None]
    if tokens:
        first = min(m.first_token_time for m in tokens)
        out[Attr.TTFT] = first - arrival
        out[Attr.PREFILL_TIME] = max(m.first_token_time - m.first_scheduled_time
                                     for m in tokens)
        out[Attr.DECODE_TIME] = max((m.finish_time or end) - m.first_token_time
                                    for m in tokens)
        out[Attr.INFERENCE_TIME] = max((m.finish_time or end) - m.first_scheduled_time
                                       for m in tokens)
    return out


def _failure(error: BaseException) -> tuple[str, str, int | None]:
    """(status description, error.type, HTTP status or None) of what ended the request."""
    if isinstance(error, _GONE):
        return "the client disconnected", "client_disconnected", 499
    if isinstance(error, APIError):
        return error.message, str(error.status), error.status
    return f"{type(error).__name__}: {error}", type(error).__name__, None


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
