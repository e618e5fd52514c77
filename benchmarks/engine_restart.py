"""What an engine crash and a hung step cost the clients of ``llmctl serve``: how fast every
open stream ends, how long ``/health`` stays 503, and when the next request succeeds.

    python benchmarks/engine_restart.py                     # 3 rounds of each fault
    python benchmarks/engine_restart.py --rounds 1 --streams 8 --out-dir /tmp/restart \\
        --allow-dirty                                        # a smoke run

Server: SmolLM2-135M in bf16 with ``serve_vs_vllm.py``'s limits (pinned to every CPU this
process may use), the engine in its supervised process (the default), a fresh server per
round. Client: the openai SDK (``AsyncOpenAI``, streamed completions, temperature 0, EOS
ignored), ``--streams`` requests at once with different prompts.

Faults:

- ``sigkill``: once half of the streams have a token, ``SIGKILL`` the engine process (the
  forkserver's child under the server). Measured from the kill: when the last stream
  ended (an error event: the SDK raises), how long ``/health`` answered 503 (polled every
  20 ms), and when a new completion succeeded; ``llmctl:engine_restarts_total`` after.
- ``hang``: the server starts with ``$LLMCTL_ENGINE_FAULT=hang@20`` (the engine stops
  stepping after its 20th step) and ``--engine-step-timeout`` (default 5 s). Measured: from
  the last token any stream received to the first stream error (the detection time, which
  should be the timeout plus at most the supervisor's 50 ms wait), and the same recovery
  times as above.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common
import serve_vs_vllm as svv

FAULTS = ("sigkill", "hang")


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def engine_pids(server_pid: int) -> list[int]:
    """The engine processes: children of the server's forkserver child."""
    pids = []
    for child in _children(server_pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"forkserver" in cmdline:
            pids += _children(child)
    return pids


def _health(base: str) -> int:
    import httpx

    try:
        return httpx.get(base + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0


async def _stream(client, prompt: str, max_tokens: int, seen: dict, i: int) -> dict:
    got = 0
    try:
        stream = await client.completions.create(
            model=svv.SERVED_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                got += 1
                seen[i] = time.monotonic()
        return {"tokens": got, "ended": time.monotonic(), "error": None}
    except Exception as exc:  # noqa: BLE001 - what the SDK raised is the measurement
        return {"tokens": got, "ended": time.monotonic(), "error": f"{type(exc).__name__}: {exc}"}


async def _round(base: str, server_pid: int, fault: str, streams: int, max_tokens: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    seen: dict[int, float] = {}
    tasks = [asyncio.create_task(_stream(client, f"Story {i}: once upon a time", max_tokens,
                                         seen, i)) for i in range(streams)]
    out: dict = {}
    if fault == "sigkill":
        while len(seen) < streams // 2:
            await asyncio.sleep(0.005)
        pids = engine_pids(server_pid)
        out["engine_pids"] = pids
        t0 = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
    results = await asyncio.gather(*tasks)
    if fault == "hang":
        t0 = max(seen.values()) if seen else time.monotonic()  # the last token anyone got
        out["detection_s"] = round(min(r["ended"] for r in results if r["error"]) - t0, 3)
    out["all_streams_ended_s"] = round(max(r["ended"] for r in results) - t0, 3)
    out["streams"] = streams
    out["streams_with_tokens"] = sum(r["tokens"] > 0 for r in results)
    out["streams_ended_in_error"] = sum(r["error"] is not None for r in results)
    out["streams_completed"] = sum(r["error"] is None for r in results)
    out["example_error"] = next((r["error"] for r in results if r["error"]), None)
    unhealthy = None
    while True:  # /health: 503 until the new engine is ready
        code = await asyncio.to_thread(_health, base)
        if code == 200:
            break
        unhealthy = unhealthy or time.monotonic()
        await asyncio.sleep(0.02)
    out["healthy_after_s"] = round(time.monotonic() - t0, 3)
    out["saw_503"] = unhealthy is not None
    while True:
        try:
            done = await client.completions.create(model=svv.SERVED_NAME, prompt="Hello",
                                                   max_tokens=8, temperature=0)
            out["next_completion_tokens"] = done.usage.completion_tokens
            break
        except Exception:  # noqa: BLE001 - retry as a client following Retry-After would
            await asyncio.sleep(0.05)
    out["next_request_ok_after_s"] = round(time.monotonic() - t0, 3)
    await client.close()
    return out


def _restarts(base: str) -> float | None:
    import httpx

    from llmctl.bench.server_metrics import parse_prometheus

    try:
        text = httpx.get(base + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    return parse_prometheus(text).get("llmctl:engine_restarts_total")


def run_one(fault: str, rnd: int, args, model: str, lim: svv.Limits, log_dir: Path) -> dict:
    from llmctl.bench.launcher import LaunchedServer, free_port
    from llmctl.errors import LlmctlError

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    record = {"name": f"round {rnd} {fault}", "round": rnd, "fault": fault}
    cmd = svv.full_command("llmctl", args, model, port, lim)
    if fault == "hang":
        cmd = ["env", f"LLMCTL_ENGINE_FAULT=hang@{args.hang_after}", *cmd,
               "--engine-step-timeout", str(args.step_timeout)]
    record["server_command"] = cmd
    launched = LaunchedServer(cmd, base, timeout=args.start_timeout,
                              log_path=log_dir / f"r{rnd}-{fault}.server.log")
    try:
        launched.__enter__()
    except LlmctlError as exc:
        record["error"] = f"server did not start: {exc}"
        return record
    try:
        record["startup_s"] = round(launched.startup_seconds, 1)
        record["warm_up"] = svv.warm_up(port)
        with common.measured_round(record, len(lim.cpus)):
            record["result"] = asyncio.run(_round(base, launched.process.pid, fault,
                                                  args.streams, args.max_tokens))
        record["result"]["engine_restarts_total"] = _restarts(base)
    finally:
        launched.stop()
    return record


def render_markdown(report: dict) -> str:
    cfg = report["config"]
    lines = common.header_markdown(report, "llmctl serve: engine crash and hung step, "
                                           "time to recover")
    lines += [(f"SmolLM2 bf16, serve_vs_vllm limits, CPUs {cfg['limits']['cpus']}; "
               f"{cfg['streams']} streamed completions at once (openai SDK, "
               f"{cfg['max_tokens']} tokens each, EOS ignored). sigkill: SIGKILL to the engine "
               "process once half the streams have a token. hang: the engine stops stepping "
               f"after step {cfg['hang_after']}, --engine-step-timeout {cfg['step_timeout']} s. "
               "Times from the kill (sigkill) or from the last token any stream got (hang)."),
              "", ("| round | fault | streams with tokens | ended in error / completed | "
                   "detection s | all streams ended s | /health 200 after s | next request "
                   "OK after s | restarts | load before / after |"), "|" + "---|" * 10]
    for r in report["results"]["runs"]:
        if "result" not in r:
            lines.append(f"| {r['round']} | {r['fault']} | error: {r.get('error', '?')} |"
                         + " |" * 7)
            continue
        x = r["result"]
        lines.append(
            f"| {r['round']} | {r['fault']} | {x['streams_with_tokens']}/{x['streams']} | "
            f"{x['streams_ended_in_error']} / {x['streams_completed']} | "
            f"{x.get('detection_s', '-')} | {x['all_streams_ended_s']} | "
            f"{x['healthy_after_s']} | {x['next_request_ok_after_s']} | "
            f"{x['engine_restarts_total']} | {r['load_before'][0]} / {r['load_after'][0]} |")
    s = report["results"]["summary"]
    lines += ["", "Medians over rounds: " + "; ".join(
        f"{fault}: streams ended {v['all_streams_ended_s']} s, healthy {v['healthy_after_s']} "
        f"s, next request {v['next_request_ok_after_s']} s"
        + (f", detection {v['detection_s']} s" if v.get("detection_s") is not None else "")
        for fault, v in s.items()) + ".", "",
        "Example error a stream got: `" + str(next(
            (r["result"]["example_error"] for r in report["results"]["runs"]
             if r.get("result", {}).get("example_error")), ""))[:300] + "`"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--hang-after", type=int, default=20)
    ap.add_argument("--step-timeout", type=float, default=5.0)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--label", default="smollm2")
    common.add_run_arguments(ap)
    args = ap.parse_args(argv)
    from llmctl.models.resolve import resolve_model

    model = str(resolve_model(args.model).path)
    cpus = tuple(common.cpus())
    lim = svv.Limits("bfloat16", 1024, 64, 2048, 2, cpus)
    log_dir = Path(f"/tmp/llmctl-engine-restart/{args.label}-{time.strftime('%Y%m%d-%H%M%S')}")
    log_dir.mkdir(parents=True, exist_ok=True)
    report = common.start_run("engine-restart", {
        "model": args.model, "model_path": model, "limits": asdict(lim),
        "streams": args.streams, "max_tokens": args.max_tokens, "hang_after": args.hang_after,
        "step_timeout": args.step_timeout, "rounds": args.rounds, "log_dir": str(log_dir)},
        allow_dirty=args.allow_dirty, threads=len(cpus), out=args.out_dir)
    runs = []
    for rnd in range(1, args.rounds + 1):
        for fault in FAULTS:
            print(f"[restart] round {rnd} {fault} ...", file=sys.stderr, flush=True)
            rec = run_one(fault, rnd, args, model, lim, log_dir)
            runs.append(rec)
            print(f"[restart]   {rec.get('result', rec.get('error'))}", file=sys.stderr,
                  flush=True)
    keys = ("all_streams_ended_s", "healthy_after_s", "next_request_ok_after_s", "detection_s")
    summary = {fault: {k: common.median([r["result"].get(k) for r in runs
                                         if r["fault"] == fault and "result" in r])
                       for k in keys} for fault in FAULTS}
    report["results"] = {"runs": runs, "summary": summary}
    common.finish_run(report, runs)
    markdown = render_markdown(report)
    common.write_report(Path(args.out_dir), f"engine-restart-{args.label}", report, markdown)
    print(markdown)
    bad = [r["name"] for r in runs if "result" not in r
           or r["result"]["streams_completed"] + r["result"]["streams_ended_in_error"]
           != r["result"]["streams"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
