"""Prometheus metrics, named like vLLM's (``vllm:x`` -> ``llmctl:x``) so dashboards
and ``llmctl bench``'s scraper carry over with a prefix swap."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from llmctl.serve.engine.stats import EngineStats

PREFIX = "llmctl:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


_LOAD_FIELD = {"flops": "flops", "bytes": "bytes", "busy_seconds": "seconds"}


class _EngineGauges:
    """Reads the engine's last stats snapshot at scrape time (no polling thread)."""

    def __init__(self, snapshot: Callable[[], EngineStats], model: str, peaks=None) -> None:
        self._snapshot = snapshot
        self._model = model
        self._peaks = peaks  # llmctl.perf.peaks.Peaks, or None: hardware unknown

    def collect(self):
        stats = self._snapshot()
        table = (
            ("num_requests_running", "Requests in the running batch.", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).",
             stats.kv_cache_usage),
            ("prefix_cache_hit_rate", "Prefix cache hits / queries (tokens).",
             stats.prefix_cache_hit_rate),
        )
        for name, doc, value in table:
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            gauge.add_metric([self._model], float(value))
            yield gauge
        counters = (
            ("num_preemptions", "Sequences preempted (recompute).", stats.num_preemptions),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_queried_tokens),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache.",
             stats.prefix_cache_hit_tokens),
            ("spec_decode_num_draft_tokens", "Draft tokens proposed.", stats.spec_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
             stats.spec_accepted_tokens),
            ("engine_steps", "Engine steps that ran the model.", stats.num_steps),
        )
        from prometheus_client.core import CounterMetricFamily

        for name, doc, value in counters:
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric([self._model], float(value))
            yield counter
        phases = CounterMetricFamily(
            PREFIX + "engine_step_phase_seconds", "Engine thread wall time in each phase of "
            "a step (schedule, forward, sample, update, output).", labels=["model_name", "phase"])
        for phase, seconds in stats.step_phase_seconds.items():
            phases.add_metric([self._model, phase], float(seconds))
        yield phases
        yield from self._supervisor(stats)
        yield from self._utilization(stats)

    def _supervisor(self, stats: EngineStats):
        """Engine processes (llmctl.serve.proc): absent when the engine runs in-process."""
        from prometheus_client.core import CounterMetricFamily

        if stats.engine_restarts is None:
            return
        restarts = CounterMetricFamily(PREFIX + "engine_restarts", "Engine process restarts "
                                       "(a crash, a hung step, --max-rss).",
                                       labels=["model_name"])
        restarts.add_metric([self._model], float(stats.engine_restarts))
        yield restarts
        up = GaugeMetricFamily(PREFIX + "engine_replicas_up", "Engine processes ready to take "
                               "requests.", labels=["model_name"])
        up.add_metric([self._model], float(stats.engine_replicas_up or 0))
        yield up

    def _utilization(self, stats: EngineStats):
        """FLOPs, bytes and busy seconds by phase since start (counters: ``llmctl bench``
        takes their deltas over a run), and MFU/MBU over the meter's sliding window
        (gauges, labelled with where the peaks came from; absent when unknown)."""
        from prometheus_client.core import CounterMetricFamily

        from llmctl.perf.meter import WINDOW_SECONDS
        from llmctl.perf.utilization import COUNTER_FIELDS, use

        totals = stats.perf_totals
        if not totals:
            return
        # one series per phase by name, not by label: a scraper summing label sets (as
        # llmctl bench's does) keeps the phases apart
        for phase, load in totals.items():
            for field, what in COUNTER_FIELDS.items():
                counter = CounterMetricFamily(PREFIX + f"{phase}_{field}",
                                              f"{what} of {phase} engine steps "
                                              "(llmctl.perf.meter).", labels=["model_name"])
                counter.add_metric([self._model], float(getattr(load, _LOAD_FIELD[field])))
                yield counter
        if self._peaks is None:
            return
        dtype = stats.perf_dtype
        labels = ["model_name", "phase", "peak_source"]
        mfu = GaugeMetricFamily(PREFIX + "mfu", f"Achieved FLOP/s over the {dtype} peak, "
                                f"engine steps of the last {WINDOW_SECONDS:g} s.", labels=labels)
        mbu = GaugeMetricFamily(PREFIX + "mbu", "Achieved read bytes/s over the peak "
                                f"bandwidth, engine steps of the last {WINDOW_SECONDS:g} s.",
                                labels=labels)
        for phase, load in stats.perf_recent.items():
            u = use(phase, load, self._peaks, dtype)
            if u.mfu is not None:
                mfu.add_metric([self._model, phase, self._peaks.source], u.mfu)
            if u.mbu is not None:
                mbu.add_metric([self._model, phase, self._peaks.source], u.mbu)
        yield mfu
        yield mbu


class ServerMetrics:
    def __init__(self, model: str, snapshot: Callable[[], EngineStats], peaks=None) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        labels = ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end latency.",
                             labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.",
                                     labels, registry=self.registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.",
                                         labels, registry=self.registry)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests.",
                                       labels + ["finished_reason"], registry=self.registry)
        self.http_errors = Counter(PREFIX + "http_errors", "Requests answered with an error.",
                                   labels + ["status"], registry=self.registry)
        # Per tenant: label values come only from the auth file's tenant names (plus
        # "unknown" for keys that matched none) and a fixed set of reasons, never from
        # what a client sends, so the series stay bounded.
        self.tenant_requests = Counter(PREFIX + "tenant_requests", "Requests admitted, by "
                                       "tenant.", labels + ["tenant"], registry=self.registry)
        self.tenant_tokens = Counter(PREFIX + "tenant_tokens", "Tokens consumed (prompt, "
                                     "generation), by tenant.", labels + ["tenant", "kind"],
                                     registry=self.registry)
        self.tenant_rejections = Counter(PREFIX + "tenant_rejections", "Requests refused by "
                                         "authentication, model access or a limit.",
                                         labels + ["tenant", "reason"], registry=self.registry)
        self.registry.register(_EngineGauges(snapshot, model, peaks))

    def observe_finished(self, *, reason: str, prompt_tokens: int, output_tokens: int,
                         ttft: float | None, e2e: float) -> None:
        m = self.model
        self.request_success.labels(m, reason).inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(output_tokens)
        self.e2e.labels(m).observe(e2e)
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
            if output_tokens > 1:
                self.tpot.labels(m).observe((e2e - ttft) / (output_tokens - 1))

    def tenant_known(self, tenant: str) -> None:
        """Start a tenant's series at zero (dashboards see it before its first request)."""
        self.tenant_requests.labels(self.model, tenant)
        for kind in ("prompt", "generation"):
            self.tenant_tokens.labels(self.model, tenant, kind)

    def tenant_admitted(self, tenant: str) -> None:
        self.tenant_requests.labels(self.model, tenant).inc()

    def tenant_consumed(self, tenant: str, prompt_tokens: int, generation_tokens: int) -> None:
        self.tenant_tokens.labels(self.model, tenant, "prompt").inc(prompt_tokens)
        self.tenant_tokens.labels(self.model, tenant, "generation").inc(generation_tokens)

    def tenant_rejected(self, tenant: str, reason: str) -> None:
        self.tenant_rejections.labels(self.model, tenant, reason).inc()

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
