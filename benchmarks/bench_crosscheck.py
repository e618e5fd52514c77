"""Cross-check ``llmctl bench`` against guidellm (a tool no one here wrote).

Both tools run the same workload against the same server, one after the other and in
alternating order (llmctl, guidellm, guidellm, llmctl, ...) so drift on a shared
machine hits both: random/synthetic prompts of ``--input-len`` tokens, exactly
``--output-len`` output tokens (``ignore_eos``), a fixed number of concurrent streams,
``--num-prompts`` requests per level, streaming ``/v1/completions``.

Compared per level (medians over requests; guidellm's from its per-request records):

- TTFT: both measure send -> first streamed token.
- TPOT: llmctl's (E2E - TTFT) / (out - 1) against guidellm's ``inter_token_latency_ms``
  ((last token - first token) / (out - 1), the same quantity). guidellm's
  ``time_per_output_token_ms`` divides by all tokens *including* the first; it is
  reported next to llmctl's equivalent (E2E / out) for reference only.
- E2E latency, and output throughput = output tokens / wall duration of the level.

Target: every ratio within 15 % (0.85 .. 1.15).

    python benchmarks/bench_crosscheck.py --server fake            # fake server, realistic delays
    python benchmarks/bench_crosscheck.py --server llmctl --model smollm2-135m
    python benchmarks/bench_crosscheck.py --server llama-cpp --gguf F.gguf
    python benchmarks/bench_crosscheck.py --server url --target http://127.0.0.1:8000 \
        --served-model-name NAME

Writes ``results/bench-crosscheck-<server>.json`` and ``.md`` with the exact commands,
the commit (a dirty tree is refused unless ``--allow-dirty``) and, for each run, the load
before and after and the CPU other processes used meanwhile (``common.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import common

GUIDELLM = "/work/venvs/guidellm/bin/guidellm"
TOLERANCE = 0.15
# A CPU server serving SmolLM2-ish speeds: prefill per token, decode slowed by load.
FAKE_DELAYS = ["--ttft-ms", "60", "--prefill-ms-per-token", "0.5", "--itl-ms", "25",
               "--itl-ms-per-running", "4"]


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_seconds(pid: int | None) -> float | None:
    """utime + stime of a process (the server), from /proc."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measured(fn):
    """Run one tool; add the server's CPU seconds and the client's (whole process)."""
    def wrapper(args, url, name, concurrency, out_dir, server_pid=None):
        server0, client0 = cpu_seconds(server_pid), children_cpu()
        record = {"name": f"{fn.__name__.removeprefix('run_')} c={concurrency}"}
        with common.measured_round(record, args.threads):
            result = fn(args, url, name, concurrency, out_dir)
        result["round"] = record
        server1 = cpu_seconds(server_pid)
        result["client_cpu_s"] = round(children_cpu() - client0, 2)
        if server0 is not None and server1 is not None:
            result["server_cpu_s"] = round(server1 - server0, 2)
            result["server_cpu_ms_per_output_token"] = round(
                1000 * (server1 - server0) / max(1, result["output_tokens"]), 2)
        return result
    return wrapper


def start_server(args) -> tuple[subprocess.Popen | None, str, str, list[str] | None]:
    """(process, base URL, served model name, command)."""
    from llmctl.bench.launcher import LaunchedServer, free_port

    if args.server == "url":
        return None, args.target.rstrip("/"), args.served_model_name, None
    port = free_port()
    env_threads = {"OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE"}
    if args.server == "fake":
        name = args.served_model_name or "fake-model"
        cmd = [sys.executable, str(REPO / "tests/bench/fake_server.py"), "--port", str(port),
               "--model", name, *FAKE_DELAYS]
    elif args.server == "llmctl":
        name = args.served_model_name or args.model
        cmd = [sys.executable, "-m", "llmctl", "serve", args.model, "--port", str(port),
               "--served-model-name", name, "--threads", str(args.threads),
               *shlex.split(args.serve_args or "")]
    elif args.server == "llama-cpp":
        name = args.served_model_name or Path(args.gguf).stem
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", args.gguf, "--host",
               "127.0.0.1", "--port", str(port), "--model_alias", name, "--n_threads",
               str(args.threads), "--n_ctx", "4096"]
    else:
        raise SystemExit(f"unknown --server {args.server}")
    os.environ.update(env_threads)
    health = "/v1/models" if args.server == "llama-cpp" else "/health"
    server = LaunchedServer(cmd, f"http://127.0.0.1:{port}", timeout=600, health_path=health)
    server.__enter__()
    return server, f"http://127.0.0.1:{port}", name, cmd


@measured
def run_llmctl(args, url: str, name: str, concurrency: int, out_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "llmctl", "bench", "--target", url, "--model", name,
           "--served-model-name", name, "--tokenizer", str(args.tokenizer),
           "--dataset", "random", "--input-len", str(args.input_len), "--output-len",
           str(args.output_len), "--ignore-eos", "-n", str(args.num_prompts),
           "--max-concurrency", str(concurrency), "--request-rate", "inf",
           "--seed", str(args.seed), "--result-dir", str(out_dir), "--no-plots",
           "--metrics-interval", "0", "--json"]
    before = load()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"llmctl bench failed:\n{proc.stderr}\n{proc.stdout}")
    [path] = json.loads(proc.stdout)["reports"]
    report = json.loads(Path(path).read_text())
    e2e_per_token = [e / o * 1000 for e, o, err in zip(report["e2els"], report["output_lens"],
                                                      report["errors"]) if not err and o]
    return {
        "command": shlex.join(["python", "-m", "llmctl", *cmd[3:]]),
        "load_before": before, "load_after": load(), "wall_s": time.perf_counter() - t0,
        "completed": report["completed"], "failed": report["failed"],
        "ttft_ms": report["median_ttft_ms"], "tpot_ms": report["median_tpot_ms"],
        "e2el_ms": report["median_e2el_ms"],
        "tpot_incl_first_ms": statistics.median(e2e_per_token) if e2e_per_token else None,
        "output_throughput": report["output_throughput"],
        "request_throughput": report["request_throughput"],
        "output_tokens": report["total_output_tokens"], "duration_s": report["duration"],
        "mean_prompt_tokens": report["total_input_tokens"] / max(1, report["completed"]),
        # Little's law: mean requests in flight = sum of latencies / duration.
        "mean_concurrency": sum(e for e, err in zip(report["e2els"], report["errors"])
                                if e is not None and not err) / report["duration"],
        "report": path,
    }


@measured
def run_guidellm(args, url: str, name: str, concurrency: int, out_dir: Path) -> dict:
    out = out_dir / f"guidellm-c{concurrency}-{time.time_ns()}.json"
    cmd = [args.guidellm, "run",
           "--backend", f"kind=openai_http,target={url},model={name},"
                        "request_format=/v1/completions",
           "--tokenizer", f"kind=huggingface_auto,model={args.tokenizer}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},"
                     f"output_tokens={args.output_len}",
           "--profile", f"kind=concurrent,streams={concurrency}",
           "--constraint", f"kind=max_requests,count={args.num_prompts}",
           "--seed", f"kind=static,value={args.seed}",
           "--output", f"kind=json,path={out}", "--disable-progress"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    before = load()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0 or not out.is_file():
        raise SystemExit(f"guidellm failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    bench = json.loads(out.read_text())["benchmarks"][0]
    done = bench["requests"]["successful"]

    def med(key, scale=1.0):
        values = [r[key] * scale for r in done if r.get(key) is not None]
        return statistics.median(values) if values else None

    out_tokens = sum(r["output_tokens"] or 0 for r in done)
    return {
        "command": shlex.join(cmd),
        "load_before": before, "load_after": load(), "wall_s": time.perf_counter() - t0,
        "completed": len(done), "failed": bench["metrics"]["request_totals"]["errored"],
        "ttft_ms": med("time_to_first_token_ms"), "tpot_ms": med("inter_token_latency_ms"),
        "e2el_ms": med("request_latency", 1000.0),
        "tpot_incl_first_ms": med("time_per_output_token_ms"),
        "output_throughput": out_tokens / bench["duration"],
        "request_throughput": len(done) / bench["duration"],
        "output_tokens": out_tokens, "duration_s": bench["duration"],
        "mean_prompt_tokens": statistics.mean(r["prompt_tokens"] or 0 for r in done),
        "mean_concurrency": sum(r["request_latency"] for r in done) / bench["duration"],
        "guidellm_output_tokens_per_second_mean":
            bench["metrics"]["output_tokens_per_second"]["successful"]["mean"],
        "report": str(out),
    }


COMPARED = ("ttft_ms", "tpot_ms", "e2el_ms", "output_throughput", "request_throughput")
INFO = ("tpot_incl_first_ms", "mean_prompt_tokens", "mean_concurrency",
        "server_cpu_ms_per_output_token", "client_cpu_s")
INFO_LABELS = {
    "tpot_incl_first_ms": "E2E/out vs guidellm time_per_output_token (info)",
    "mean_prompt_tokens": "prompt tokens per request (server usage; info)",
    "mean_concurrency": "requests in flight, mean (sum of E2E / duration; info)",
    "server_cpu_ms_per_output_token": "server CPU ms per output token (info)",
    "client_cpu_s": "client process CPU s incl. start-up (info)",
}


def median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def markdown(result: dict) -> str:
    lines = [*common.header_markdown(result["run"], "`llmctl bench` vs guidellm cross-check"),
             f"- server: {result['server']} ({result['target']}), model `{result['model']}`",
             f"- workload: random {result['input_len']} in / {result['output_len']} out "
             f"(ignore_eos), {result['num_prompts']} requests per level, concurrency "
             f"{result['concurrency']}, {result['rounds']} round(s) per tool, alternating",
             f"- machine: {result['machine']['cpu']}, {result['machine']['cores']} cores; "
             f"load average before/after: {result['load_start']} / {result['load_end']}",
             f"- {result['guidellm_version']}; tolerance ±{TOLERANCE:.0%}",
             f"- command: `{result['command']}`", "",
             "| concurrency | metric | llmctl | guidellm | ratio | within 15% |",
             "|---:|---|---:|---:|---:|:---:|"]
    for level in result["levels"]:
        for key in COMPARED + INFO:
            row = level["compare"][key]
            if row["llmctl"] is None or row["guidellm"] is None:
                continue
            ok = "" if key in INFO else ("yes" if row["within"] else "**no**")
            lines.append(f"| {level['concurrency']} | {INFO_LABELS.get(key, key)} | "
                         f"{row['llmctl']:.2f} | {row['guidellm']:.2f} | {row['ratio']:.3f} | "
                         f"{ok} |")
    lines += ["", f"All compared ratios within 15%: **{result['all_within']}**", "",
              "TPOT: llmctl's (E2E - TTFT)/(out - 1) vs guidellm's inter_token_latency_ms "
              "(last - first token)/(out - 1). guidellm's time_per_output_token_ms includes "
              "the first token, so it is compared with llmctl's E2E/out only for reference.",
              "", "Commands of the first round:", ""]
    for level in result["levels"]:
        lines += [f"- c={level['concurrency']} llmctl: `{level['llmctl_runs'][0]['command']}`",
                  f"- c={level['concurrency']} guidellm: `{level['guidellm_runs'][0]['command']}`"]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", choices=["fake", "llmctl", "llama-cpp", "url"], default="fake")
    p.add_argument("--target", help="base URL with --server url")
    p.add_argument("--model", default="smollm2-135m", help="model for --server llmctl")
    p.add_argument("--gguf", help="GGUF file for --server llama-cpp")
    p.add_argument("--served-model-name")
    p.add_argument("--serve-args", help="extra flags for llmctl serve")
    p.add_argument("--tokenizer", help="tokenizer dir (default: the embedded SmolLM2's)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--rounds", type=int, default=1, help="runs per tool per level")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="server threads")
    p.add_argument("--guidellm", default=GUIDELLM)
    p.add_argument("-o", "--output", help="JSON path (default results/bench-crosscheck-"
                                          "<server>.json)")
    p.add_argument("--allow-dirty", action="store_true",
                   help="measure an uncommitted tree anyway (the output says DIRTY)")
    args = p.parse_args()
    if args.tokenizer is None:
        from llmctl.models.resolve import resolve_model

        args.tokenizer = resolve_model("smollm2-135m").path
    from llmctl.report import machine, run_metadata

    levels = [int(c) for c in args.concurrency.split(",")]
    output = Path(args.output or REPO / "results" / f"bench-crosscheck-{args.server}.json")
    frame = common.start_run("bench-crosscheck", {"server": args.server, "levels": levels,
                                                  "rounds": args.rounds},
                             allow_dirty=args.allow_dirty, threads=args.threads, out=output)
    version = subprocess.run([args.guidellm, "--version"], capture_output=True,
                             text=True, check=False).stdout.strip()
    load_start = load()
    server, url, name, server_cmd = start_server(args)
    result_levels = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for c in levels:
                runs = {"llmctl": [], "guidellm": []}
                for r in range(args.rounds):
                    order = ("llmctl", "guidellm") if r % 2 == 0 else ("guidellm", "llmctl")
                    for tool in order:
                        fn = run_llmctl if tool == "llmctl" else run_guidellm
                        runs[tool].append(fn(args, url, name, c, Path(tmp),
                                             server_pid=server.process.pid if server else None))
                        print(f"c={c} {tool}: " + ", ".join(
                            f"{k} {runs[tool][-1][k]:.2f}" for k in COMPARED), flush=True)
                compare = {}
                for key in COMPARED + INFO:
                    a, b = median_of(runs["llmctl"], key), median_of(runs["guidellm"], key)
                    ratio = a / b if a is not None and b else None
                    compare[key] = {"llmctl": a, "guidellm": b, "ratio": ratio,
                                    "within": ratio is not None
                                    and abs(ratio - 1) <= TOLERANCE}
                for tool_runs in runs.values():
                    for run in tool_runs:
                        run.pop("report", None)
                result_levels.append({"concurrency": c, "compare": compare,
                                      "llmctl_runs": runs["llmctl"],
                                      "guidellm_runs": runs["guidellm"]})
    finally:
        if server is not None:
            server.__exit__(None, None, None)
    result = {
        "server": args.server, "server_command": server_cmd, "target": url, "model": name,
        "input_len": args.input_len, "output_len": args.output_len,
        "num_prompts": args.num_prompts, "concurrency": levels, "rounds": args.rounds,
        "guidellm_version": version, "tolerance": TOLERANCE,
        "command": shlex.join(["python", *sys.argv]),
        "load_start": load_start, "load_end": load(), "machine": machine(),
        "levels": result_levels,
        "all_within": all(level["compare"][k]["within"] for level in result_levels
                          for k in COMPARED),
        "metadata": run_metadata(fake_server_delays=FAKE_DELAYS if args.server == "fake"
                                 else None),
        "run": common.finish_run(frame, [run["round"] for level in result_levels
                                         for tool in ("llmctl_runs", "guidellm_runs")
                                         for run in level[tool]]),
    }
    common.write_report(output.parent, output.stem, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
