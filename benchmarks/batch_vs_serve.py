"""What ``llmctl batch`` gains over the same requests sent to ``llmctl serve``: output
tokens/s of one OpenAI batch file run in-process against ``llmctl serve`` + ``llmctl
bench`` sending the same bodies at full concurrency, alternating.

    python benchmarks/batch_vs_serve.py                    # 3 rounds: batch/serve, serve/batch, ...
    python benchmarks/batch_vs_serve.py --rounds 1 --num-prompts 4 --input-len 16 \\
        --output-len 8 --out-dir /tmp/batch-smoke --allow-dirty   # a smoke run

Model and limits: SmolLM2-135M in bf16 with ``serve_vs_vllm.py``'s limits (max_model_len
1024, max_num_seqs 64, 2048 batched tokens, 2 GiB KV, chunked prefill and prefix caching
on), pinned with ``taskset`` to every CPU this process may use, one torch thread per CPU;
the same for both sides.

Workload: ``llmctl bench``'s random dataset (256 prompts of 128 tokens, 128 out, EOS
ignored, greedy, seed 0), built here with the bench's own loader and the model's
tokenizer; the batch file holds the bench's own ``/v1/completions`` bodies (the bench's
backend builds them) without ``stream``. The bench report's dataset fingerprint must
equal the one computed here: the same prompts on both sides.

- batch: ``llmctl batch IN.jsonl -o OUT.jsonl MODEL --json``; its throughput is its
  summary's ``output_throughput``: completion tokens / seconds from the first line in to
  the last line out (the model load excluded; its first, cold step included: no
  warm-up). Every line must be a 200 with ``output_len`` completion tokens.
- serve: a fresh ``llmctl serve`` (``--max-queue`` above the prompt count: nothing is
  refused), one short warm-up request, then ``llmctl bench`` sending every request at
  once (rate inf, no concurrency cap); its throughput is the bench's
  ``output_throughput`` (output tokens / the bench's duration). The server runs its
  engine in an engine process (the default).

Each round runs both sides back to back (batch first in odd rounds, serve first in even
ones); the ratio batch/serve of output tokens/s is taken within a round, and the summary
is the median over rounds. Every round records the load before/after and the CPU other
processes used (``common.py``); wall times with start-up (model load, server start) are
kept beside the measured spans.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common
import serve_vs_vllm as svv

fmt = common.fmt  # a table cell: '?' when not measured

SIDES = ("batch", "serve")


@dataclass(frozen=True)
class Workload:
    num_prompts: int = 256
    input_len: int = 128
    output_len: int = 128
    seed: int = 0


def build_input(model: str, w: Workload, path: Path) -> str:
    """The batch file of the bench's requests; returns the workload's fingerprint."""
    from llmctl.bench.backends import RequestSettings, get_backend
    from llmctl.bench.datasets import DatasetSpec, build_dataset, fingerprint
    from llmctl.models.loading import load_tokenizer

    spec = DatasetSpec(name="random", num_prompts=w.num_prompts, input_len=w.input_len,
                       output_len=w.output_len, seed=w.seed)
    samples = build_dataset(spec, load_tokenizer(Path(model)))
    backend = get_backend("openai-completions")
    settings = RequestSettings(base_url="", model=svv.SERVED_NAME, ignore_eos=True,
                               temperature=0.0)
    with open(path, "w") as f:
        for i, sample in enumerate(samples):
            body = backend.body(sample, settings)
            body.pop("stream"), body.pop("stream_options")  # one response body per line
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST",
                                "url": backend.path, "body": body}) + "\n")
    return fingerprint(samples)


def limit_flags(lim: svv.Limits) -> list[str]:
    return ["--dtype", lim.dtype, "--max-model-len", str(lim.max_model_len),
            "--max-num-seqs", str(lim.max_num_seqs),
            "--max-num-batched-tokens", str(lim.max_num_batched_tokens),
            "--kv-cache-memory", f"{lim.kv_gib}GiB", "--threads", str(len(lim.cpus))]


def pinned(cmd: list[str], lim: svv.Limits) -> list[str]:
    env = [f"{k}={v}" for k, v in svv.server_env("llmctl", lim).items()]
    return ["env", *env, "taskset", "-c", ",".join(map(str, lim.cpus)), *cmd]


def batch_command(model: str, lim: svv.Limits, src: Path, out: Path,
                  extra: tuple[str, ...] = ()) -> list[str]:
    return pinned([sys.executable, "-m", "llmctl", "batch", str(src), "-o", str(out), model,
                   "--served-model-name", svv.SERVED_NAME, *limit_flags(lim), *extra, "--json"],
                  lim)


def client_command(model: str, port: int, w: Workload, out: Path) -> list[str]:
    return [sys.executable, "-m", "llmctl", "bench", "--target", f"http://127.0.0.1:{port}",
            "--model", model, "--served-model-name", svv.SERVED_NAME, "--dataset", "random",
            "--num-prompts", str(w.num_prompts), "--input-len", str(w.input_len),
            "--output-len", str(w.output_len), "--ignore-eos", "--temperature", "0",
            "--seed", str(w.seed), "--no-plots", "--result-dir", str(out),
            "--label", out.name]


def check_batch_output(path: Path, w: Workload) -> str | None:
    """None when every line is a 200 with ``output_len`` tokens, else what is wrong."""
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    if len(lines) != w.num_prompts:
        return f"{len(lines)} output lines for {w.num_prompts} requests"
    for line in lines:
        response = line["response"] or {}
        if response.get("status_code") != 200:
            return f"{line['custom_id']}: {json.dumps(line)[:300]}"
        tokens = response["body"]["usage"]["completion_tokens"]
        if tokens != w.output_len:
            return f"{line['custom_id']}: {tokens} completion tokens, not {w.output_len}"
    return None


def run_batch_side(rnd: int, model: str, lim: svv.Limits, w: Workload, src: Path,
                   log_dir: Path, side: str = "batch", extra: tuple[str, ...] = ()) -> dict:
    """One ``llmctl batch`` run (``extra``: more flags; ``side``: its label)."""
    stem = f"r{rnd}-{side}"
    out = log_dir / f"{stem}.out.jsonl"
    cmd = batch_command(model, lim, src, out, extra)
    record = {"name": f"round {rnd} {side}", "round": rnd, "side": side, "command": cmd}
    start = time.perf_counter()
    with common.measured_round(record, len(lim.cpus)), \
            open(log_dir / f"{stem}.log", "w") as log:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                              check=False)
    record["process_wall_s"] = round(time.perf_counter() - start, 2)
    record["exit_code"] = proc.returncode
    try:
        summary = json.loads(proc.stdout)
    except ValueError:
        summary = None
    if proc.returncode != 0 or summary is None:
        record["error"] = f"llmctl batch failed (exit {proc.returncode}): see {log.name}"
        return record
    problem = check_batch_output(out, w)
    if problem:
        record["error"] = f"bad batch output: {problem}"
        return record
    record["result"] = {"output_throughput": summary["output_throughput"],
                        "duration": summary["seconds"],
                        "completion_tokens": summary["completion_tokens"],
                        "prompt_tokens": summary["prompt_tokens"]}
    return record


BENCH_KEYS = ("output_throughput", "request_throughput", "completed", "failed", "duration",
              "total_output_tokens", "median_ttft_ms", "median_tpot_ms", "median_e2el_ms")


def run_serve_side(rnd: int, model: str, lim: svv.Limits, w: Workload, fingerprint: str,
                   args, log_dir: Path) -> dict:
    from llmctl.bench.launcher import LaunchedServer, free_port
    from llmctl.errors import LlmctlError

    port = free_port()
    stem = f"r{rnd}-serve"
    cmd = pinned(svv.llmctl_command(model, port, lim)
                 + ["--max-queue", str(w.num_prompts + 1)], lim)
    record = {"name": f"round {rnd} serve", "round": rnd, "side": "serve",
              "server_command": cmd}
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
        client = client_command(model, port, w, out)
        record["client_command"] = client
        with common.measured_round(record, len(lim.cpus)), \
                open(log_dir / f"{stem}.client.log", "w") as log:
            proc = subprocess.run(client, stdout=log, stderr=subprocess.STDOUT,
                                  env=common.thread_env(len(lim.cpus)), check=False)
        record["client_exit_code"] = proc.returncode
    finally:
        record["server_exit_code"] = launched.stop()
        record["port_freed"] = svv.port_free(port)
    reports = sorted(out.glob("*.json"))
    if proc.returncode != 0 or not reports:
        record["error"] = f"llmctl bench failed (exit {proc.returncode}): see {stem}.client.log"
        return record
    report = json.loads(reports[-1].read_text())
    result = {k: report.get(k) for k in BENCH_KEYS}
    record["bench_report"] = str(reports[-1])
    if report["dataset"]["fingerprint"] != fingerprint:
        record["error"] = "the bench sent other prompts than the batch file holds"
    elif result["failed"] or result["completed"] != w.num_prompts:
        record["error"] = f"{result['failed']} failed, {result['completed']} completed"
    elif result["total_output_tokens"] != w.num_prompts * w.output_len:
        record["error"] = f"{result['total_output_tokens']} output tokens"
    record["result"] = result
    return record


def render_markdown(report: dict) -> str:
    cfg, res = report["config"], report["results"]
    w, lim = cfg["workload"], cfg["limits"]
    lines = common.header_markdown(report, "llmctl batch vs llmctl serve + llmctl bench")
    lines += [(f"SmolLM2 `{cfg['model']}` {lim['dtype']}, max_num_seqs {lim['max_num_seqs']}, "
               f"max_num_batched_tokens {lim['max_num_batched_tokens']}, KV {lim['kv_gib']} "
               f"GiB, CPUs {lim['cpus']}, the same for both. {w['num_prompts']} random prompts "
               f"of {w['input_len']} tokens, {w['output_len']} out, EOS ignored, greedy, seed "
               f"{w['seed']} (fingerprint `{cfg['fingerprint'][:12]}`); serve: all sent at "
               "once by `llmctl bench` after one warm-up request; batch: the same bodies in "
               "one file, no warm-up."),
              f"Logs, outputs and bench reports: `{cfg['log_dir']}`.", "",
              ("| round | side | output tok/s | measured s | wall s with start-up | "
               "load before / after | other procs (cores) |"), "|" + "---|" * 7]
    for r in res["runs"]:
        if "error" in r:
            lines.append(f"| {r['round']} | {r['side']} | error: {r['error'][:200]} |"
                         + " |" * 4)
            continue
        x = r["result"]
        wall = (r["process_wall_s"] if r["side"] == "batch"
                else round(r["startup_s"] + x["duration"], 1))
        lines.append(f"| {r['round']} | {r['side']} | {fmt(x['output_throughput'], '.1f')} | "
                     f"{fmt(x['duration'], '.1f')} | {wall} | "
                     f"{r['load_before'][0]} / {r['load_after'][0]} | "
                     f"{r['foreign_cpu_cores']} |")
    lines += [""] + common.ab_markdown(res["per_round"], res["summary"],
                                       [("batch", "batch"), ("serve", "serve")],
                                       [("batch_over_serve", "batch / serve")])
    lines += ["", ("Measured spans: batch, first line in to last line out (its summary); serve, "
                   "the bench's duration (first request sent to last response done).")]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_workload_arguments(ap, num_prompts=Workload.num_prompts,
                                  input_len=Workload.input_len, output_len=Workload.output_len,
                                  cpus_help="CPU list for both sides (default: all this "
                                            "process may use)")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    common.add_run_arguments(ap)
    args = ap.parse_args(argv)
    from llmctl.models.resolve import resolve_model

    model = str(resolve_model(args.model).path)
    cpus = common.cpu_list(args.cpus)
    lim = svv.Limits("bfloat16", 1024, 64, 2048, 2, cpus)
    w = Workload(args.num_prompts, args.input_len, args.output_len, args.seed)
    log_dir = Path(f"/tmp/llmctl-batch-vs-serve/{args.label}-{time.strftime('%Y%m%d-%H%M%S')}")
    log_dir.mkdir(parents=True, exist_ok=True)
    src = log_dir / "input.jsonl"
    fingerprint = build_input(model, w, src)
    report = common.start_run("batch-vs-serve", {
        "model": args.model, "model_path": model, "limits": asdict(lim), "workload": asdict(w),
        "rounds": args.rounds, "fingerprint": fingerprint, "log_dir": str(log_dir),
        "order": "batch first in odd rounds, serve first in even rounds"},
        allow_dirty=args.allow_dirty, threads=len(cpus), out=args.out_dir)
    runs = []
    for rnd in range(1, args.rounds + 1):
        for side in SIDES if rnd % 2 else SIDES[::-1]:
            print(f"[batch-vs-serve] round {rnd} {side} ...", file=sys.stderr, flush=True)
            rec = (run_batch_side(rnd, model, lim, w, src, log_dir) if side == "batch" else
                   run_serve_side(rnd, model, lim, w, fingerprint, args, log_dir))
            runs.append(rec)
            print("[batch-vs-serve]   " + (rec.get("error") or
                                           f"{rec['result']['output_throughput']:.1f} tok/s"),
                  file=sys.stderr, flush=True)
    per_round, summary = common.ab_throughput(runs, args.rounds, SIDES, "batch_over_serve")
    report["results"] = {"runs": runs, "per_round": per_round, "summary": summary}
    common.finish_run(report, runs)
    markdown = render_markdown(report)
    common.write_report(Path(args.out_dir), f"batch-vs-serve-{args.label}", report, markdown)
    print(markdown)
    bad = [r["name"] for r in runs if "error" in r]
    if bad:
        print(f"[batch-vs-serve] runs that failed: {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
