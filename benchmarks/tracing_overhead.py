"""What tracing costs: ``llmctl serve`` with ``--otlp-traces-endpoint`` (every request's
spans exported to a local OTLP/HTTP receiver) against the same server without it,
alternating, on the same workload and client.

    python benchmarks/tracing_overhead.py                  # 3 rounds: off/on, on/off, off/on
    python benchmarks/tracing_overhead.py --rounds 1 --num-prompts 4 --output-len 8 \\
        --out-dir /tmp/tracing-smoke --allow-dirty          # a smoke run

Server: SmolLM2-135M in bf16 with ``serve_vs_vllm.py``'s limits (max_model_len 1024,
max_num_seqs 64, 2048 batched tokens, 2 GiB KV, chunked prefill and prefix caching on,
pinned to every CPU this process may use, one torch thread per CPU), a fresh server for
every run, one short warm-up request before the measurement.

Client: ``llmctl bench`` (the random dataset: 64 prompts of 128 tokens, 128 out, all sent
at once, EOS ignored, greedy, seed 0; the same prompts in every run). It sends a sampled
W3C ``traceparent`` with every request, so with tracing on every request is recorded,
under the client's trace id, which is how a traced deployment is driven.

Receiver: an OTLP/HTTP endpoint on a thread of this process that answers 200 to every
POST and keeps the bodies (the cost of a collector stays off the server, as in a
deployment; its few milliseconds count as this benchmark's own CPU, not as contention).
The server exports with the SDK's defaults (BatchSpanProcessor: every 5 s, and at
shutdown). After each traced run, with the server stopped, the bodies are decoded
(``opentelemetry-proto``) to count the spans and check that every completed bench record's
trace id has its ``llm_request`` span; an untraced run must send nothing.

Each round runs both sides back to back (off first in odd rounds, on first in even ones);
the ratio on/off of output tokens/s is taken within a round, never across rounds, and the
summary is the median over rounds. Every round is reported with the load before/after and
the CPU other processes used (``common.py``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common
import serve_vs_vllm as svv

fmt = common.fmt  # a table cell: '?' when not measured

SIDES = ("off", "on")


@dataclass(frozen=True)
class Workload:
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 128


class OtlpSink:
    """A collector's OTLP/HTTP endpoint that accepts everything and keeps the bodies."""

    def __init__(self) -> None:
        bodies = self.bodies = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                bodies.append(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def take(self) -> list[bytes]:
        bodies, self.bodies[:] = list(self.bodies), []
        return bodies

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def decode_spans(bodies: list[bytes]) -> dict:
    """Span counts by name and the trace ids of the ``llm_request`` spans."""
    try:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )
    except ImportError:
        return {"posts": len(bodies), "bytes": sum(map(len, bodies)),
                "decoded": False, "request_trace_ids": []}
    names: dict[str, int] = {}
    traces = []
    for body in bodies:
        for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    names[span.name] = names.get(span.name, 0) + 1
                    if span.name == "llm_request":
                        traces.append(span.trace_id.hex())
    return {"posts": len(bodies), "bytes": sum(map(len, bodies)), "decoded": True,
            "spans_by_name": names, "request_trace_ids": traces}


def server_command(side: str, model: str, port: int, lim: svv.Limits, sink: OtlpSink) -> list:
    base = svv.llmctl_command(model, port, lim)
    if side == "on":
        base += ["--otlp-traces-endpoint", sink.url]
    env = [f"{k}={v}" for k, v in svv.server_env("llmctl", lim).items()]
    return ["env", *env, "taskset", "-c", ",".join(map(str, lim.cpus)), *base]


def client_command(model: str, port: int, w: Workload, seed: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "llmctl", "bench", "--target", f"http://127.0.0.1:{port}",
            "--model", model, "--served-model-name", svv.SERVED_NAME, "--dataset", "random",
            "--num-prompts", str(w.num_prompts), "--input-len", str(w.input_len),
            "--output-len", str(w.output_len), "--ignore-eos", "--temperature", "0",
            "--seed", str(seed), "--no-plots", "--result-dir", str(out),
            "--label", out.name]


BENCH_KEYS = ("output_throughput", "request_throughput", "completed", "failed", "duration",
              "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
              "median_itl_ms", "median_e2el_ms")


def run_one(side: str, rnd: int, args, model: str, lim: svv.Limits, w: Workload,
            sink: OtlpSink, log_dir: Path) -> dict:
    from llmctl.bench.launcher import LaunchedServer, free_port
    from llmctl.errors import LlmctlError

    port = free_port()
    stem = f"r{rnd}-{side}"
    record = {"name": f"round {rnd} tracing {side}", "round": rnd, "side": side}
    cmd = server_command(side, model, port, lim, sink)
    record["server_command"] = cmd
    sink.take()
    launched = LaunchedServer(cmd, f"http://127.0.0.1:{port}", timeout=args.start_timeout,
                              log_path=log_dir / f"{stem}.server.log")
    try:
        launched.__enter__()
    except LlmctlError as exc:
        record["error"] = f"server did not start: {exc}"
        return record
    out = log_dir / stem
    try:
        record["startup_s"] = round(launched.startup_seconds, 1)
        record["warm_up"] = svv.warm_up(port)
        client = client_command(model, port, w, args.seed, out)
        record["client_command"] = client
        with common.measured_round(record, len(lim.cpus)), \
                open(log_dir / f"{stem}.client.log", "w") as log:
            proc = subprocess.run(client, stdout=log, stderr=subprocess.STDOUT,
                                  env=common.thread_env(len(lim.cpus)), check=False)
        record["client_exit_code"] = proc.returncode
    finally:
        record["server_exit_code"] = launched.stop()  # SIGTERM: the last spans leave here
        record["port_freed"] = svv.port_free(port)
    reports = sorted(out.glob("*.json"))
    if proc.returncode != 0 or not reports:
        record["error"] = (f"llmctl bench failed (exit {proc.returncode}): see "
                           f"{log_dir / (stem + '.client.log')}")
        return record
    report = json.loads(reports[-1].read_text())
    record["result"] = {k: report.get(k) for k in BENCH_KEYS}
    record["bench_report"] = str(reports[-1])
    spans = decode_spans(sink.take())
    sent = [t for t, e in zip(report["trace_ids"], report["errors"]) if t and not e]
    traced = set(spans.pop("request_trace_ids"))
    spans["bench_records"] = len(sent)
    spans["bench_records_with_server_span"] = sum(t in traced for t in sent)
    record["spans"] = spans
    return record


def summarize(runs: list[dict], rounds: int) -> tuple[list[dict], dict]:
    per_round = []
    for rnd in range(1, rounds + 1):
        got = {r["side"]: r["result"] for r in runs if r["round"] == rnd and "result" in r}
        if set(got) != set(SIDES) or not got["off"]["output_throughput"]:
            continue
        off, on = got["off"], got["on"]
        per_round.append({
            "round": rnd,
            "output_throughput_on_over_off": on["output_throughput"] / off["output_throughput"],
            "median_tpot_on_over_off": (on["median_tpot_ms"] / off["median_tpot_ms"]
                                        if on["median_tpot_ms"] and off["median_tpot_ms"]
                                        else None)})
    summary = {side: {k: common.median([r["result"][k] for r in runs
                                        if r["side"] == side and "result" in r])
                      for k in ("output_throughput", "median_tpot_ms", "median_ttft_ms")}
               for side in SIDES}
    for key in ("output_throughput_on_over_off", "median_tpot_on_over_off"):
        summary[key] = common.median([p[key] for p in per_round])
    ratio = summary["output_throughput_on_over_off"]
    summary["overhead_percent"] = None if ratio is None else 100 * (1 - ratio)
    return per_round, summary


def render_markdown(report: dict) -> str:
    cfg, res = report["config"], report["results"]
    w, lim = cfg["workload"], cfg["limits"]
    lines = common.header_markdown(report, "llmctl serve: tracing on vs off")
    lines += [(f"SmolLM2 `{cfg['model']}` {lim['dtype']}, max_num_seqs {lim['max_num_seqs']}, "
               f"max_num_batched_tokens {lim['max_num_batched_tokens']}, KV {lim['kv_gib']} GiB, "
               f"CPUs {lim['cpus']}; a fresh server per run. Client `llmctl bench`: "
               f"{w['num_prompts']} random prompts of {w['input_len']} tokens, {w['output_len']}"
               " out, all at once, EOS ignored, a sampled traceparent per request. Tracing on: "
               "`--otlp-traces-endpoint` to an OTLP/HTTP receiver in the benchmark process "
               "(SDK defaults: batches every 5 s)."),
              f"Logs and bench reports: `{cfg['log_dir']}`.", "",
              ("| round | tracing | output tok/s | TPOT p50 ms | TTFT p50 ms | failed | "
               "spans received | records with a server span | load before / after | "
               "other procs (cores) |"), "|" + "---|" * 10]
    for r in res["runs"]:
        if "result" not in r:
            lines.append(f"| {r['round']} | {r['side']} | error: {r.get('error', '?')[:200]} |"
                         + " |" * 7)
            continue
        x, s = r["result"], r["spans"]
        received = sum(s.get("spans_by_name", {}).values()) if s["decoded"] else \
            f"{s['posts']} posts"
        joined = "-" if r["side"] == "off" else \
            f"{s['bench_records_with_server_span']}/{s['bench_records']}"
        lines.append(
            f"| {r['round']} | {r['side']} | {fmt(x['output_throughput'], '.1f')} | "
            f"{fmt(x['median_tpot_ms'], '.1f')} | {fmt(x['median_ttft_ms'], '.0f')} | "
            f"{x['failed']} | {received} | {joined} | "
            f"{r['load_before'][0]} / {r['load_after'][0]} | "
            f"{r['foreign_cpu_cores']} |")
    lines += ["", "| round | output tok/s on/off | TPOT p50 on/off |", "|---|---|---|"]
    lines += [f"| {p['round']} | {p['output_throughput_on_over_off']:.3f} | "
              f"{fmt(p['median_tpot_on_over_off'], '.3f')} |" for p in res["per_round"]]
    s = res["summary"]
    lines += ["", (f"Median over rounds: output throughput "
                   f"{fmt(s['off']['output_throughput'], '.1f')} tok/s off, "
                   f"{fmt(s['on']['output_throughput'], '.1f')} on; on/off "
                   f"{fmt(s['output_throughput_on_over_off'], '.3f')} (overhead "
                   f"{fmt(s['overhead_percent'], '.1f')}%), TPOT p50 on/off "
                   f"{fmt(s['median_tpot_on_over_off'], '.3f')}."),
              "", "TPOT as vLLM defines it: (E2E - TTFT) / (output tokens - 1), per request."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_workload_arguments(ap, num_prompts=Workload.num_prompts,
                                  input_len=Workload.input_len, output_len=Workload.output_len,
                                  cpus_help="CPU list for the server (default: all this "
                                            "process may use)")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    common.add_run_arguments(ap)
    args = ap.parse_args(argv)
    from llmctl.models.resolve import resolve_model

    model = str(resolve_model(args.model).path)
    cpus = common.cpu_list(args.cpus)
    lim = svv.Limits("bfloat16", 1024, 64, 2048, 2, cpus)
    w = Workload(args.num_prompts, args.input_len, args.output_len)
    log_dir = Path(f"/tmp/llmctl-tracing-overhead/{args.label}-{time.strftime('%Y%m%d-%H%M%S')}")
    log_dir.mkdir(parents=True, exist_ok=True)
    report = common.start_run("tracing-overhead", {
        "model": args.model, "model_path": model, "limits": asdict(lim), "workload": asdict(w),
        "rounds": args.rounds, "seed": args.seed, "log_dir": str(log_dir),
        "order": "off first in odd rounds, on first in even rounds",
        "exporter": "OTLP/HTTP protobuf, BatchSpanProcessor defaults"},
        allow_dirty=args.allow_dirty, threads=len(cpus), out=args.out_dir)
    sink = OtlpSink()
    runs = []
    try:
        for rnd in range(1, args.rounds + 1):
            for side in SIDES if rnd % 2 else SIDES[::-1]:
                print(f"[tracing] round {rnd} tracing {side} ...", file=sys.stderr, flush=True)
                rec = run_one(side, rnd, args, model, lim, w, sink, log_dir)
                runs.append(rec)
                r = rec.get("result")
                print("[tracing]   " + (f"{r['output_throughput']:.1f} tok/s, spans "
                                        f"{rec['spans'].get('spans_by_name')}" if r
                                        else rec.get("error", "?")), file=sys.stderr, flush=True)
    finally:
        sink.close()
    per_round, summary = summarize(runs, args.rounds)
    report["results"] = {"runs": runs, "per_round": per_round, "summary": summary}
    common.finish_run(report, runs)
    markdown = render_markdown(report)
    common.write_report(Path(args.out_dir), f"tracing-overhead-{args.label}", report, markdown)
    print(markdown)
    bad = [r["name"] for r in runs if "result" not in r
           or (r["side"] == "on" and r["spans"]["bench_records_with_server_span"]
               != r["spans"]["bench_records"])
           or (r["side"] == "off" and r["spans"]["posts"])]
    if bad:
        print(f"[tracing] runs that failed or whose spans do not match: {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
