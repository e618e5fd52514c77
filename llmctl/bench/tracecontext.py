"""A fresh W3C Trace Context per benchmark request, so its record joins the server's trace.

``traceparent`` is ``00-<trace id: 32 hex>-<parent span id: 16 hex>-<flags: 2 hex>``
(W3C Trace Context, section 3.2); flags 01 = sampled, asking a tracing server (``llmctl
serve --otlp-traces-endpoint``, vLLM's ``--otlp-traces-endpoint``) to record the request.
The parent span id names the client's side of the call; servers that do not trace ignore
the header. Ids come from the OS's random source, never from the run's seeded generator,
so a benchmark's workload stays the same whether or not it traces.
"""

from __future__ import annotations

import secrets

SAMPLED = "01"


def new_traceparent() -> tuple[str, str]:
    """(header value, trace id) for one request. All-zero ids are invalid (section 3.2.2.3
    and 3.2.2.4), hence the ``or 1``."""
    trace_id = f"{secrets.randbits(128) or 1:032x}"
    span_id = f"{secrets.randbits(64) or 1:016x}"
    return f"00-{trace_id}-{span_id}-{SAMPLED}", trace_id
