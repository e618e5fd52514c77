"""`llmctl check` on SmolLM2: a cold run, a warm run (nothing changed) and the same work
done by hand with the single commands, measured in one run.

Targets (issue 15): apart from the measurements it is asked to repeat (serving and
benchmarking every candidate again), the warm run takes under 10% of the cold run's
time; the cold run takes at most 5% longer than the single commands doing the same work
(`llmctl quantize`, `llmctl bench` starting and stopping `llmctl serve`, `llmctl eval`,
per candidate, in the same order).

    .venv/bin/python benchmarks/check_pipeline.py [--rounds 2]

The pipeline is `examples/check-smollm2.yaml` (W4 RTN, W4 GPTQ, W8 GPTQ; the workload and
eval it names); the by-hand commands are derived from the same file, so both sides do
the same work with the same options. Every run starts from an empty `$LLMCTL_HOME`
(cold: the embedded model is imported, calibration drawn, the reference scored), except
the warm run, which reuses the cold run's home. Rounds alternate which side goes first
(check cold + warm, then by hand; then by hand first), every round is reported with the
load before it and the CPU time other processes took during it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    ROOT,
    add_run_arguments,
    finish_run,
    header_markdown,
    measured_round,
    median,
    start_run,
    write_report,
)

EXAMPLE = ROOT / "examples" / "check-smollm2.yaml"
REPEATED = ("serve", "bench ")  # steps a warm run measures again, by design


def llmctl() -> str:
    return str(Path(sys.executable).with_name("llmctl"))


def run(argv: list[str], env: dict[str, str], log: Path) -> float:
    start = time.perf_counter()
    with log.open("a") as handle:
        handle.write(f"$ {shlex.join(argv)}\n")
        handle.flush()
        proc = subprocess.run(argv, env=env, stdout=handle, stderr=subprocess.STDOUT,
                              check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(argv)} exited {proc.returncode}: see {log}")
    return time.perf_counter() - start


def by_hand_commands(pipeline, work: Path) -> list[list[str]]:
    """The single commands doing what the pipeline does, candidate by candidate."""
    q, (w,), ev = pipeline.quantize, pipeline.bench, pipeline.eval
    exe, commands = llmctl(), []
    for cand in q.candidates():
        ckpt = work / cand.name
        commands.append([exe, "quantize", pipeline.model, "--recipe", cand.recipe,
                         "--samples", str(q.samples), "--seq-len", str(q.seq_len),
                         "--seed", str(q.seed), "--calib-dtype", q.calib_dtype,
                         "--output", str(ckpt), "--json"])
        commands.append([exe, "bench", "--model", str(ckpt), "--dtype", pipeline.serve.dtype,
                         "--dataset", w.dataset, "--num-prompts", str(w.num_prompts),
                         "--input-len", str(w.input_len), "--output-len", str(w.output_len),
                         "--max-concurrency", str(w.max_concurrency),
                         "--repeat", str(w.repeat), "--seed", str(w.seed),
                         "--ignore-eos" if w.ignore_eos else "--no-ignore-eos",
                         "--label", w.name, "--result-dir", str(work / "bench" / cand.name),
                         "-o", f"{w.name}.json", "--json"])
        commands.append([exe, "eval", str(ckpt), "--reference", pipeline.model,
                         "--data", ev.data, "--ctx", str(ev.ctx),
                         "--max-windows", str(ev.max_windows), "--top-k", str(ev.top_k),
                         "--dtype", ev.dtype, "--output", str(work / "eval" / f"{cand.name}.json"),
                         "--json", *[a for g in pipeline.gates for a in ("--gate", g)]])
    return commands


def check_run(home: Path, out: Path, log: Path) -> dict:
    env = {**os.environ, "LLMCTL_HOME": str(home)}
    wall = run([llmctl(), "check", str(EXAMPLE), "-o", str(out), "--json"], env, log)
    report = json.loads((out / "report.json").read_text())
    steps = [s for c in report["candidates"] for s in c["steps"]]
    repeated = sum(s["seconds"] for s in steps if s["step"].startswith(REPEATED))
    return {"wall_s": round(wall, 2), "repeated_measurements_s": round(repeated, 2),
            "rest_s": round(wall - repeated, 2),
            "steps": {c["name"]: {s["step"]: s["status"] for s in c["steps"]}
                      for c in report["candidates"]},
            "verdict": report["verdict"]["passed"], "best": report["verdict"]["best"]}


def hand_run(pipeline, work: Path, log: Path) -> dict:
    env = {**os.environ, "LLMCTL_HOME": str(work / "home")}
    times = [round(run(argv, env, log), 2) for argv in by_hand_commands(pipeline, work)]
    return {"wall_s": round(sum(times), 2), "commands_s": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    add_run_arguments(parser)
    args = parser.parse_args()
    from llmctl.check.pipeline import load_pipeline

    pipeline = load_pipeline(EXAMPLE)
    report = start_run("check-pipeline", {"pipeline": str(EXAMPLE.relative_to(ROOT)),
                                          "rounds": args.rounds},
                       allow_dirty=args.allow_dirty, threads=2, out=args.out_dir)
    report["by_hand_commands"] = [shlex.join(c) for c in by_hand_commands(
        pipeline, Path("WORK"))]
    rounds = []
    scratch = Path(tempfile.mkdtemp(prefix="llmctl-check-bench-"))
    log = scratch / "commands.log"
    for i in range(args.rounds):
        order = ("check", "by_hand") if i % 2 == 0 else ("by_hand", "check")
        for side in order:
            work = scratch / f"r{i}-{side}"
            if side == "check":
                for phase in ("cold", "warm"):
                    with measured_round({"name": f"round {i + 1} check {phase}",
                                         "side": f"check {phase}", "round": i + 1},
                                        2) as record:
                        record.update(check_run(work / "home", work / phase, log))
                    rounds.append(record)
                    print(record, flush=True)
            else:
                with measured_round({"name": f"round {i + 1} by hand",
                                     "side": "by hand", "round": i + 1}, 2) as record:
                    record.update(hand_run(pipeline, work, log))
                rounds.append(record)
                print(record, flush=True)
            shutil.rmtree(work, ignore_errors=True)
    report["rounds"] = rounds
    report = finish_run(report, rounds)

    per_round = []
    for i in range(1, args.rounds + 1):
        got = {r["side"]: r for r in rounds if r["round"] == i}
        cold, warm, hand = got["check cold"], got["check warm"], got["by hand"]
        per_round.append({
            "round": i,
            "warm_rest_over_cold": round(warm["rest_s"] / cold["wall_s"], 4),
            "warm_rest_over_cold_rest": round(warm["rest_s"] / cold["rest_s"], 4),
            "check_over_by_hand": round(cold["wall_s"] / hand["wall_s"], 4)})
    summary = {k: median([p[k] for p in per_round]) for k in per_round[0] if k != "round"}
    report["per_round"], report["summary"] = per_round, summary
    report["targets"] = {"warm_rest_over_cold": "< 0.10", "check_over_by_hand": "<= 1.05"}
    report["met"] = {"warm_rest_over_cold": summary["warm_rest_over_cold"] < 0.10,
                     "check_over_by_hand": summary["check_over_by_hand"] <= 1.05}

    lines = header_markdown(report, "llmctl check on SmolLM2: cold, warm, and by hand")
    lines += [(f"Pipeline `{report['config']['pipeline']}` (3 candidates: quantize, serve + "
              "bench 2 rounds, eval). Each cold run and each by-hand run starts from an empty "
              "`$LLMCTL_HOME`; the warm run reuses the cold run's. The by-hand commands (same "
              "options, derived from the pipeline file):"), ""]
    lines += [f"    {c}" for c in report["by_hand_commands"]] + [""]
    lines += [("| round | run | wall s | serve + bench s (re-measured) | rest s | load before |"
              " other CPU (cores) |"), "|---|---|---|---|---|---|---|"]
    for r in rounds:
        lines.append(f"| {r['round']} | {r['side']} | {r['wall_s']:.1f} | "
                     f"{r.get('repeated_measurements_s', '–')} | {r.get('rest_s', '–')} | "
                     f"{r['load_before'][0]} | {r['foreign_cpu_cores']} |")
    lines += ["", "| round | warm rest / cold | warm rest / cold rest | check cold / by hand |",
              "|---|---|---|---|"]
    for p in per_round:
        lines.append(f"| {p['round']} | {p['warm_rest_over_cold']:.1%} | "
                     f"{p['warm_rest_over_cold_rest']:.1%} | {p['check_over_by_hand']:.3f}x |")
    lines += ["", (f"Median: the warm run, apart from serving and benchmarking again, takes "
                   f"{summary['warm_rest_over_cold']:.1%} of the cold run (target < 10%: "
                   f"{'met' if report['met']['warm_rest_over_cold'] else 'NOT met'}); "
                   f"check's cold run takes {summary['check_over_by_hand']:.3f}x the single "
                   f"commands' time (target <= 1.05x: "
                   f"{'met' if report['met']['check_over_by_hand'] else 'NOT met'}).")]
    path = write_report(Path(args.out_dir), "check-pipeline-smollm2", report,
                        "\n".join(lines) + "\n")
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
