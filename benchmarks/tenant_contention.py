"""Tenant contention on ``llmctl serve --scheduling-policy fair``: does one tenant's flood
leave another tenant's interactive latency alone, and does batch work still finish?

    python benchmarks/tenant_contention.py                  # 3 rounds x (baseline, contention)
    python benchmarks/tenant_contention.py --rounds 1 --b-requests 4 --b-rate 2 \\
        --warmup 2 --calibration-requests 4 --out-dir /tmp/smoke --allow-dirty   # a smoke run

Tenants, from one ``--auth-file`` written per run (keys made up on the spot; the file
holds only their SHA-256, as the server wants):

- ``A`` (standard) floods: Poisson arrivals at ``--a-load`` (4) x the measured capacity,
  with a ``requests_per_minute`` limit of ``--a-limit`` x capacity (its token bucket
  starts full: the first burst is part of the flood);
- ``A-batch`` (batch) sends one request per round, the aging probe;
- ``B`` (interactive) sends short requests, Poisson at ``--b-rate``.

0. Calibration, on its own fresh server: capacity = completed requests per second of A's
   shape over a closed burst of ``--calibration-requests`` sent at once.
1. Rounds alternate (baseline first in odd rounds, contention first in even ones), each
   on a fresh server pinned to the same CPUs, after one warm-up request:
   - baseline: B's schedule and the batch probe on an otherwise idle server;
   - contention: A floods from t = 0; after ``--warmup`` s, B's schedule (the same seeded
     arrivals as the baseline) and the batch probe start; A stops when B's last request
     has been sent.
2. Verdicts: B's p95 TTFT under contention over its baseline p95 (medians over rounds),
   target <= 2 (issue 18); A's refusals by reason (429 rate limit, 429 full queue, 503
   deadline admission, 408 timeout); the batch probe's wait in the server's queue
   against its aging bound, ``2 x --aging-seconds`` (batch is two classes below
   interactive: llmctl.serve.core.policy). Aging bounds the wait until a request is
   scheduled; its TTFT adds the step in flight and its own prefill, and its E2E its
   decode, both reported. The wait is the server's ``queue`` span (arrival to first
   scheduled) of the probe's trace: every server runs with ``--otlp-traces-endpoint`` to
   an OTLP/HTTP receiver in this process (``tracing_overhead.OtlpSink``; tracing costs no
   measurable throughput: results/tracing-overhead-smollm2), and the client's
   ``traceparent`` names the trace.

The server gets ``--request-timeout`` (deadline admission refuses what cannot finish in
it): keep it above the aging bound plus the probe's own run, or the probe can only time
out. The clients run on the same CPUs as the server (there are two): B and the probe
stream from this process (TTFT per request), A's flood goes unstreamed from a process of
its own, so its event loop cannot delay B's timestamps (its CPU still competes, as a
real flood's network stack would). Every request's record is in the JSON (raw arrays,
vLLM's names).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common
import tracing_overhead

SERVED_NAME = "smollm2"
TENANTS = {"A": "standard", "A-batch": "batch", "B": "interactive"}
WARMUP_PROMPT = "Warm-up: say something short about the sea."
KINDS = ("baseline", "contention")
TTFT_RATIO_TARGET = 2.0  # issue 18: B's p95 TTFT within 2x its unloaded value
# Refusal reasons: by (HTTP status, error code) when the body the client kept (its first
# 300 characters) still holds the code, else by how the server's message begins.
REASONS = {(429, "rate_limit_exceeded"): "429 rate limit", (429, "queue_full"): "429 queue full",
           (503, "deadline_unmeetable"): "503 deadline", (408, "request_timeout"): "408 timeout"}
MESSAGE_REASONS = (("Rate limit reached for", "429 rate limit"),
                   ("Request too large for", "429 rate limit"),
                   ("the server is at its queue limit", "429 queue full"),
                   ("the request cannot finish before its deadline", "503 deadline"),
                   ("the request did not finish within", "408 timeout"))


@dataclass(frozen=True)
class Shape:
    input_len: int
    output_len: int


@dataclass(frozen=True)
class Limits:
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_gib: int
    cpus: tuple[int, ...]
    aging_seconds: float
    request_timeout: float


# --- pure parts (tests/benchmarks/test_tenant_contention.py) -------------------------------
def auth_file_text(keys: dict[str, str], a_rpm: int | None) -> str:
    """The ``--auth-file`` YAML (JSON is YAML): digests of ``keys``, A's limit."""
    tenants = {name: {"priority_class": cls} for name, cls in TENANTS.items()}
    if a_rpm is not None:
        tenants["A"]["requests_per_minute"] = a_rpm
    entries = [{"key_sha256": hashlib.sha256(key.encode()).hexdigest(), "tenant": name}
               for name, key in keys.items()]
    return json.dumps({"tenants": tenants, "keys": entries}, indent=2) + "\n"


def refusal_reason(error: str | None) -> str | None:
    """A failed record's reason (``REASONS``), from the client's ``HTTP <status>: <body>``."""
    if error is None:
        return None
    match = re.match(r"HTTP (\d+): (.*)", error, re.DOTALL)
    if match is None:
        return "other"
    status, body = int(match.group(1)), match.group(2)
    code = re.search(r'"code":\s*"([a-z_]+)"', body)
    if code and (status, code.group(1)) in REASONS:
        return REASONS[status, code.group(1)]
    message = re.search(r'"message":\s*"(.*)', body, re.DOTALL)
    text = message.group(1) if message else body
    for prefix, reason in MESSAGE_REASONS:
        if text.startswith(prefix):
            return reason
    return f"{status} other"


def percentile(values: list[float], p: float) -> float | None:
    import numpy as np

    return float(np.percentile(values, p)) if values else None


def tenant_summary(records: list) -> dict:
    """Counts by outcome and TTFT percentiles (ms) of one tenant's records in a round."""
    ttfts = [r.ttft * 1000 for r in records if r.error is None and r.ttft is not None]
    reasons: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            key = refusal_reason(r.error)
            reasons[key] = reasons.get(key, 0) + 1
    return {"sent": len(records), "completed": sum(r.error is None for r in records),
            "refused": reasons, "p50_ttft_ms": percentile(ttfts, 50),
            "p95_ttft_ms": percentile(ttfts, 95), "p99_ttft_ms": percentile(ttfts, 99)}


def verdicts(rounds: list[dict], aging_bound: float) -> dict:
    """B's p95 TTFT ratio (medians over rounds), A's refusals, the probe vs its bound."""
    def med(kind: str, key: str) -> float | None:
        return common.median([r["tenants"]["B"][key] for r in rounds
                              if r.get("kind") == kind and "tenants" in r])

    base, loaded = med("baseline", "p95_ttft_ms"), med("contention", "p95_ttft_ms")
    ratio = loaded / base if base and loaded is not None else None
    a_refused: dict[str, int] = {}
    for r in rounds:
        if r.get("kind") == "contention" and "tenants" in r:
            for reason, n in r["tenants"]["A"]["refused"].items():
                a_refused[reason] = a_refused.get(reason, 0) + n
    probes = [r["probe"] for r in rounds if r.get("kind") == "contention" and "probe" in r]
    late = [p for p in probes if p.get("queue_s") is None or p["queue_s"] > aging_bound]
    return {"b_p95_ttft_ms_baseline": base, "b_p95_ttft_ms_contention": loaded,
            "b_p95_ttft_ratio": ratio, "b_ratio_target": TTFT_RATIO_TARGET,
            "b_within_target": None if ratio is None else ratio <= TTFT_RATIO_TARGET,
            "a_refused": a_refused,
            "a_sent": sum(r["tenants"]["A"]["sent"] for r in rounds
                          if r.get("kind") == "contention" and "tenants" in r),
            "probe_aging_bound_s": aging_bound,
            "probe_worst_queue_s": max((p["queue_s"] for p in probes
                                        if p.get("queue_s") is not None), default=None),
            "probe_worst_ttft_s": max((p["ttft_s"] for p in probes if p["ttft_s"] is not None),
                                      default=None),
            "probe_worst_e2e_s": max((p["e2e_s"] for p in probes if p["e2e_s"] is not None),
                                     default=None),
            "probes_within_bound": None if not probes else not late,
            "probes_failed": [p["error"] for p in probes if p.get("error")]}


# --- the server ----------------------------------------------------------------------------
SINK = tracing_overhead.OtlpSink()  # every server's spans (one server at a time)

def check_serve_flags() -> None:
    """Exit 2 when this tree's ``llmctl serve`` lacks a flag the test needs."""
    proc = subprocess.run([sys.executable, "-m", "llmctl", "serve", "--help"],
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"},
                          check=False)
    text = proc.stdout + proc.stderr
    missing = [flag for flag in ("--auth-file", "--scheduling-policy", "--aging-seconds")
               if flag not in text]
    if missing:
        print(f"error: `llmctl serve` in this tree has no {', '.join(missing)}: the tenants "
              "(API keys -> tenant and class, --auth-file) and the fair policy are both "
              "issue 18's; run from a tree that has them", file=sys.stderr)
        raise SystemExit(2)


SPANS = ("queue", "prefill")  # arrival -> first scheduled -> first token, server side


def span_seconds(bodies: list[bytes]) -> dict[str, dict[str, float]]:
    """Trace id (hex) -> {span name: duration} for :data:`SPANS`, from OTLP/HTTP bodies."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    out = {}
    for body in bodies:
        for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    if span.name in SPANS:
                        out.setdefault(span.trace_id.hex(), {})[span.name] = (
                            span.end_time_unix_nano - span.start_time_unix_nano) / 1e9
    return out


def server_split(records: list, spans: dict[str, dict[str, float]]) -> dict:
    """p50/p95 ms of each server span over ``records`` (where their TTFT went)."""
    out = {"traced": sum(r.trace_id in spans for r in records)}
    for name in SPANS:
        values = [spans[r.trace_id][name] * 1e3 for r in records
                  if r.trace_id in spans and name in spans[r.trace_id]]
        out[name] = {"p50_ms": percentile(values, 50), "p95_ms": percentile(values, 95)}
    return out


def server_command(model: str, port: int, lim: Limits, auth_file: Path,
                   traces_url: str) -> list[str]:
    cpus = ",".join(map(str, lim.cpus))
    env = [f"OMP_NUM_THREADS={len(lim.cpus)}", f"MKL_NUM_THREADS={len(lim.cpus)}",
           "TOKENIZERS_PARALLELISM=false"]
    return ["env", *env, "taskset", "-c", cpus, sys.executable, "-m", "llmctl", "serve", model,
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
            "--dtype", lim.dtype, "--max-model-len", str(lim.max_model_len),
            "--max-num-seqs", str(lim.max_num_seqs),
            "--max-num-batched-tokens", str(lim.max_num_batched_tokens),
            "--kv-cache-memory", f"{lim.kv_gib}GiB", "--threads", str(len(lim.cpus)),
            "--scheduling-policy", "fair", "--aging-seconds", str(lim.aging_seconds),
            "--request-timeout", str(lim.request_timeout), "--auth-file", str(auth_file),
            "--otlp-traces-endpoint", traces_url, "--log-level", "warning"]


def launched(command: list[str], log: Path, timeout: float):
    """A fresh ``llmctl serve`` (a context manager, healthy inside); its log kept."""
    from llmctl.bench.launcher import LaunchedServer

    port = int(command[command.index("--port") + 1])
    return LaunchedServer(command, f"http://127.0.0.1:{port}", timeout=timeout, log_path=log)


# --- the client ----------------------------------------------------------------------------
def samples(tokenizer, shape: Shape, n: int, seed: int) -> list:
    import numpy as np

    from llmctl.bench.datasets import random_text
    from llmctl.bench.records import SampleRequest

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        text, count = random_text(tokenizer, shape.input_len, rng)
        out.append(SampleRequest(text, count, shape.output_len))
    return out


async def drive(url: str, keys: dict[str, str], plan: list[tuple[str, object, float]],
                timeout: float) -> list[tuple[str, object]]:
    """Send ``plan`` = [(tenant, sample, seconds after start)], each at its time, with
    its tenant's key; (tenant, RequestRecord) in plan order."""
    import httpx

    from llmctl.bench.backends import RequestSettings, get_backend, send_request

    backend = get_backend("openai-completions")
    settings = {name: RequestSettings(base_url=url, model=SERVED_NAME, api_key=key,
                                      ignore_eos=True) for name, key in keys.items()}
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        origin = time.perf_counter()

        async def one(i: int, tenant: str, sample, at: float):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - origin)))
            record = await send_request(client, backend, settings[tenant], sample, i, origin)
            record.scheduled = at
            return tenant, record

        return await asyncio.gather(*(one(i, t, s, at) for i, (t, s, at) in enumerate(plan)))


async def flood(url: str, key: str, plan: list[tuple[str, int, float]],
                timeout: float) -> list:
    """A's requests, ``plan`` = [(prompt, max_tokens, seconds after start)], not streamed:
    its client then does little per request and takes less CPU from B's timings. One
    RequestRecord each (no TTFT; ``error`` in the streaming client's format)."""
    import httpx

    from llmctl.bench.records import RequestRecord

    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        origin = time.perf_counter()

        async def one(i: int, prompt: str, max_tokens: int, at: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - origin)))
            record = RequestRecord(i, 0, max_tokens, scheduled=at)
            sent = time.perf_counter()
            record.start = sent - origin
            body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            try:
                resp = await client.post(url + "/v1/completions", json=body, headers=headers)
                if resp.status_code != 200:
                    record.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                else:
                    record.output_tokens = resp.json()["usage"]["completion_tokens"]
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                record.error = f"{type(exc).__name__}: {exc}"
            record.latency = time.perf_counter() - sent
            return record

        return await asyncio.gather(*(one(i, *item) for i, item in enumerate(plan)))


def flood_process(url: str, key: str, plan: list[tuple[str, int, float]], timeout: float,
                  start_wall: float, out: str) -> None:
    """The flood in a process of its own (so its event loop does not delay B's): starts
    at the wall time ``start_wall``, writes its records to ``out`` as JSON."""
    time.sleep(max(0.0, start_wall - time.time()))
    records = asyncio.run(flood(url, key, plan, timeout))
    Path(out).write_text(json.dumps([asdict(r) for r in records]))


def run_plan(url: str, keys: dict[str, str], plan: list, timeout: float,
             out: Path) -> list[tuple[str, object]]:
    """A's part of ``plan`` in a child process, the rest here, from one wall-clock start;
    (tenant, RequestRecord) with A's last."""
    import multiprocessing

    from llmctl.bench.records import RequestRecord

    mine = [item for item in plan if item[0] != "A"]
    theirs = [(s.prompt, s.output_len, at) for tenant, s, at in plan if tenant == "A"]
    start_wall = time.time() + 1.0
    child = None
    if theirs:
        child = multiprocessing.get_context("spawn").Process(
            target=flood_process, args=(url, keys["A"], theirs, timeout, start_wall, str(out)))
        child.start()
    time.sleep(max(0.0, start_wall - time.time()))
    results = asyncio.run(drive(url, keys, mine, timeout))
    if child is None:
        return results
    child.join(max(at for _, _, at in theirs) + timeout + 60)
    if child.is_alive():
        child.terminate()
        raise RuntimeError(f"the flood client did not finish (see {out})")
    return results + [("A", RequestRecord(**r)) for r in json.loads(out.read_text())]


def warm_up(url: str, key: str) -> int:
    import httpx

    body = {"model": SERVED_NAME, "prompt": WARMUP_PROMPT, "max_tokens": 8, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=600,
                      headers={"Authorization": f"Bearer {key}"}).status_code


def calibrate(args, model: str, lim: Limits, keys: dict[str, str], tokenizer, log_dir: Path,
              shape_a: Shape) -> dict:
    """Requests per second of A's shape: a closed burst, all sent at once, no limits."""
    from llmctl.bench.launcher import free_port

    auth = log_dir / "auth-calibration.json"
    auth.write_text(auth_file_text(keys, a_rpm=None))
    port = free_port()
    record: dict = {"name": "calibration"}
    with launched(server_command(model, port, lim, auth, SINK.url),
                  log_dir / "calibration.server.log",
                  args.start_timeout) as server:
        record["warm_up_status"] = warm_up(server.base_url, keys["A"])
        burst = samples(tokenizer, shape_a, args.calibration_requests, args.seed + 1)
        with common.measured_round(record, len(lim.cpus)):
            start = time.perf_counter()
            results = asyncio.run(drive(server.base_url, keys, [("A", s, 0.0) for s in burst],
                                        timeout=lim.request_timeout + 60))
            wall = time.perf_counter() - start
    done = sum(r.error is None for _, r in results)
    record.update(requests=len(results), completed=done, wall_s=round(wall, 3),
                  capacity_rps=done / wall if wall > 0 else None)
    return record


def round_plan(kind: str, rnd: int, args, tokenizer, capacity: float,
               shapes: dict[str, Shape]) -> tuple[list, float]:
    """[(tenant, sample, at)] of one round, and when B's window opens. B's arrivals and
    prompts are the same in every round (seeded); A's flood is reseeded per round."""
    import numpy as np

    from llmctl.bench.arrivals import offsets

    opens = args.warmup if kind == "contention" else 0.0
    b_at = offsets(args.b_requests, args.b_rate, 1.0, np.random.default_rng(args.seed))
    plan = [("B", s, opens + at) for s, at in
            zip(samples(tokenizer, shapes["B"], args.b_requests, args.seed + 2), b_at)]
    plan.append(("A-batch", samples(tokenizer, shapes["probe"], 1, args.seed + 3)[0], opens))
    if kind == "contention":
        until = opens + (b_at[-1] if b_at else 0.0)
        rate = args.a_load * capacity
        n = max(1, math.ceil(rate * until))
        a_at = offsets(n, rate, 1.0, np.random.default_rng(args.seed + 100 + rnd),
                       normalize=False)
        a_samples = samples(tokenizer, shapes["A"], min(n, 64), args.seed + 4)
        plan += [("A", a_samples[i % len(a_samples)], at)
                 for i, at in enumerate(a_at) if at <= until]
    return plan, opens


def run_round(kind: str, rnd: int, args, model: str, lim: Limits, keys: dict[str, str],
              tokenizer, capacity: float, shapes: dict[str, Shape], log_dir: Path) -> dict:
    from llmctl.bench.launcher import free_port
    from llmctl.bench.metrics import raw_arrays
    from llmctl.errors import LlmctlError

    auth = log_dir / "auth.json"
    port = free_port()
    stem = f"r{rnd}-{kind}"
    record: dict = {"name": f"round {rnd} {kind}", "round": rnd, "kind": kind, "port": port}
    plan, opens = round_plan(kind, rnd, args, tokenizer, capacity, shapes)
    SINK.take()
    try:
        with launched(server_command(model, port, lim, auth, SINK.url),
                      log_dir / f"{stem}.server.log", args.start_timeout) as server:
            record["warm_up_status"] = warm_up(server.base_url, keys["B"])
            with common.measured_round(record, len(lim.cpus)):
                results = run_plan(server.base_url, keys, plan, lim.request_timeout + 60,
                                   log_dir / f"{stem}.flood.json")
    except LlmctlError as exc:
        record["error"] = f"server: {exc}"
        return record
    by_tenant: dict[str, list] = {name: [] for name in TENANTS}
    for tenant, rec in results:
        by_tenant[tenant].append(rec)
    record["tenants"] = {name: tenant_summary(recs) for name, recs in by_tenant.items()}
    (probe,) = by_tenant["A-batch"]
    spans = span_seconds(SINK.take())  # the server has stopped: its spans are all out
    record["probe"] = {"queue_s": spans.get(probe.trace_id or "", {}).get("queue"),
                       "ttft_s": probe.ttft,
                       "e2e_s": probe.latency if probe.error is None else None,
                       "error": probe.error, "sent_at_s": opens,
                       "trace_id": probe.trace_id, "traces_received": len(spans)}
    record["tenants"]["B"]["server"] = server_split(by_tenant["B"], spans)
    record["raw"] = {name: raw_arrays(recs) for name, recs in by_tenant.items()
                     if name != "A"}
    record["raw"]["A"] = {"scheduled_times": [r.scheduled for r in by_tenant["A"]],
                          "e2els": [r.latency for r in by_tenant["A"]],
                          "reasons": [refusal_reason(r.error) for r in by_tenant["A"]]}
    return record


# --- report --------------------------------------------------------------------------------
def _ms(value) -> str:
    return "?" if value is None else f"{value:.0f}"


def render_markdown(report: dict) -> str:
    cfg = report["config"]
    lim = cfg["limits"]
    res = report["results"]
    v = res["verdicts"]
    cal = res["calibration"]
    lines = common.header_markdown(report, "Tenant contention: fair scheduling, one tenant "
                                           "flooding")
    lines += [(f"Server: `llmctl serve --scheduling-policy fair --aging-seconds "
               f"{lim['aging_seconds']} --request-timeout {lim['request_timeout']}`, "
               f"{lim['dtype']}, max_num_seqs {lim['max_num_seqs']}, max_num_batched_tokens "
               f"{lim['max_num_batched_tokens']}, KV {lim['kv_gib']} GiB, CPUs {lim['cpus']}; "
               "a fresh server per round, the client on the same CPUs."),
              (f"Capacity (A's shape {cfg['shapes']['A']}, {cal.get('requests')} at once): "
               f"{cal.get('capacity_rps') or 0:.2f} req/s. A: Poisson at {cfg['a_load']}x "
               f"capacity, limit {cfg['a_rpm']} requests/min ({cfg['a_limit']}x). B: "
               f"{cfg['b_requests']} requests, Poisson {cfg['b_rate']} req/s, shape "
               f"{cfg['shapes']['B']}, opening {cfg['warmup']} s into the flood. Probe: one "
               f"batch request {cfg['shapes']['probe']}."), "",
              ("| round | kind | B p50 / p95 / p99 TTFT ms | B failed | A sent / done | "
               "A refused | probe queue / TTFT / E2E s | load before / after | other procs "
               "(cores) |"),
              "|---|---|---|---|---|---|---|---|---|"]
    for rec in res["runs"]:
        if "tenants" not in rec:
            lines.append(f"| {rec['round']} | {rec['kind']} | error: "
                         f"{rec.get('error', '?')[:200]} | | | | | | |")
            continue
        b, a, p = rec["tenants"]["B"], rec["tenants"]["A"], rec["probe"]
        refused = ", ".join(f"{k}: {n}" for k, n in sorted(a["refused"].items())) or "-"
        queue = "?" if p.get("queue_s") is None else f"{p['queue_s']:.2f}"
        probe = ("failed: " + (p["error"] or "")[:60] if p["error"] else
                 f"{queue} / {p['ttft_s']:.2f} / {p['e2e_s']:.2f}")
        lines.append(f"| {rec['round']} | {rec['kind']} | {_ms(b['p50_ttft_ms'])} / "
                     f"{_ms(b['p95_ttft_ms'])} / {_ms(b['p99_ttft_ms'])} | "
                     f"{b['sent'] - b['completed']} | {a['sent']} / {a['completed']} | "
                     f"{refused} | {probe} | {rec['load_before'][0]} / "
                     f"{rec['load_after'][0]} | {rec['foreign_cpu_cores']} |")
    ratio = v["b_p95_ttft_ratio"]
    lines += ["", ("Where B's TTFT goes, from the server's spans (queue: arrival to first "
              "scheduled; prefill: first scheduled to first token; the rest of the client's "
              "TTFT is HTTP, the API process and the pipe to the engine):"), "",
              "| round | kind | B traced | queue p50 / p95 ms | prefill p50 / p95 ms |",
              "|---|---|---|---|---|"]
    for rec in res["runs"]:
        split = rec.get("tenants", {}).get("B", {}).get("server")
        if split:
            lines.append(f"| {rec['round']} | {rec['kind']} | {split['traced']} | "
                         f"{_ms(split['queue']['p50_ms'])} / {_ms(split['queue']['p95_ms'])} | "
                         f"{_ms(split['prefill']['p50_ms'])} / "
                         f"{_ms(split['prefill']['p95_ms'])} |")
    lines += ["", "## Verdicts", "",
              (f"- B's p95 TTFT: {_ms(v['b_p95_ttft_ms_contention'])} ms under the flood vs "
               f"{_ms(v['b_p95_ttft_ms_baseline'])} ms alone (medians over rounds): "
               + ("?" if ratio is None else f"{ratio:.2f}x") + f", target <= "
               f"{v['b_ratio_target']:g}x: "
               + {True: "met", False: "NOT met", None: "not measured"}[v["b_within_target"]]
               + "."),
              (f"- A sent {v['a_sent']} requests in the contention rounds; refused: "
               + (", ".join(f"{k} {n}" for k, n in sorted(v["a_refused"].items())) or "none")
               + "."),
              ("- Batch probe under the flood: worst wait in the server's queue "
               + ("?" if v.get("probe_worst_queue_s") is None
                  else f"{v['probe_worst_queue_s']:.2f}")
               + f" s against its aging bound {v['probe_aging_bound_s']:g} s: "
               + {True: "within", False: "NOT within", None: "not measured:"}[
                   v["probes_within_bound"]] + " the bound (worst TTFT "
               + ("?" if v["probe_worst_ttft_s"] is None else f"{v['probe_worst_ttft_s']:.2f}")
               + " s, E2E "
               + ("?" if v["probe_worst_e2e_s"] is None else f"{v['probe_worst_e2e_s']:.2f}")
               + " s: the step in flight, its prefill and decode come after the wait)"
               + "".join(f"; a probe failed: {e}" for e in v.get("probes_failed", []))
               + "."), "",
              "TTFT: send -> first streamed text chunk, client side (llmctl.bench.backends).",
              f"Logs and the auth files: `{cfg['log_dir']}`."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--kv-gib", type=int, default=2)
    ap.add_argument("--cpus", default=None)
    ap.add_argument("--aging-seconds", type=float, default=15.0)
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--a-load", type=float, default=4.0, help="A's rate / capacity")
    ap.add_argument("--a-limit", type=float, default=1.0,
                    help="A's requests_per_minute / (capacity x 60)")
    ap.add_argument("--a-input-len", type=int, default=128)
    ap.add_argument("--a-output-len", type=int, default=64)
    ap.add_argument("--b-requests", type=int, default=40)
    ap.add_argument("--b-rate", type=float, default=0.5)
    ap.add_argument("--b-input-len", type=int, default=32)
    ap.add_argument("--b-output-len", type=int, default=16)
    ap.add_argument("--probe-input-len", type=int, default=128)
    ap.add_argument("--probe-output-len", type=int, default=32)
    ap.add_argument("--warmup", type=float, default=30.0,
                    help="seconds of flood before B's window opens")
    ap.add_argument("--calibration-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--label", default="smollm2-bf16")
    common.add_run_arguments(ap)
    args = ap.parse_args(argv)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before the flood's process starts
    if args.aging_seconds * 2 >= args.request_timeout:
        ap.error(f"--request-timeout {args.request_timeout:g} must exceed the batch aging "
                 f"bound 2 x --aging-seconds = {2 * args.aging_seconds:g} s, or the probe can "
                 "only time out")
    check_serve_flags()

    from llmctl.models.loading import load_tokenizer
    from llmctl.models.resolve import resolve_model

    model = str(resolve_model(args.model).path)
    tokenizer = load_tokenizer(Path(model))
    cpus = tuple(int(c) for c in args.cpus.split(",")) if args.cpus else tuple(common.cpus())
    lim = Limits(args.dtype, args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens,
                 args.kv_gib, cpus, args.aging_seconds, args.request_timeout)
    shapes = {"A": Shape(args.a_input_len, args.a_output_len),
              "B": Shape(args.b_input_len, args.b_output_len),
              "probe": Shape(args.probe_input_len, args.probe_output_len)}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = Path(args.log_dir or f"/tmp/llmctl-tenant-contention/{args.label}-{stamp}")
    log_dir.mkdir(parents=True, exist_ok=True)
    keys = {name: "sk-" + secrets.token_hex(16) for name in TENANTS}
    cfg = {"model": args.model, "model_path": model, "limits": asdict(lim),
           "shapes": {k: asdict(s) for k, s in shapes.items()}, "rounds": args.rounds,
           "a_load": args.a_load, "a_limit": args.a_limit, "b_requests": args.b_requests,
           "b_rate": args.b_rate, "warmup": args.warmup, "seed": args.seed,
           "tenants": TENANTS, "log_dir": str(log_dir),
           "order": "baseline first in odd rounds, contention first in even rounds"}
    report = common.start_run("tenant-contention", cfg, allow_dirty=args.allow_dirty,
                              threads=len(cpus), out=args.out_dir)

    from llmctl.errors import LlmctlError

    try:
        calibration = calibrate(args, model, lim, keys, tokenizer, log_dir, shapes["A"])
    except LlmctlError as exc:
        print(f"error: the calibration server: {exc}", file=sys.stderr)
        return 1
    capacity = calibration.get("capacity_rps")
    if not capacity:
        print(f"error: calibration completed no request: {log_dir}/calibration.server.log",
              file=sys.stderr)
        return 1
    cfg["a_rpm"] = max(1, math.ceil(args.a_limit * capacity * 60))
    (log_dir / "auth.json").write_text(auth_file_text(keys, cfg["a_rpm"]))
    runs = []
    try:
        for rnd in range(1, args.rounds + 1):
            for kind in (KINDS if rnd % 2 else KINDS[::-1]):
                runs.append(run_round(kind, rnd, args, model, lim, keys, tokenizer, capacity,
                                      shapes, log_dir))
                print(f"round {rnd} {kind}: B {runs[-1].get('tenants', {}).get('B')}",
                      file=sys.stderr)
    finally:
        SINK.close()
    report["results"] = {"calibration": calibration, "runs": runs,
                         "verdicts": verdicts(runs, 2 * args.aging_seconds)}
    common.finish_run(report, [calibration, *runs])
    stem = f"tenant-contention-{args.label}"
    path = common.write_report(Path(args.out_dir), stem, report, render_markdown(report))
    shutil.copy(path, log_dir / path.name)
    print(render_markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
