"""What every benchmark script records, in one place: the tree being measured (commit and
a dirty flag), the machine and versions, how busy the machine was around every round,
and the results files (written atomically).

Contention. The 1-minute load average is recorded before and after every round, but it
cannot judge a round: it lags by a minute and counts the benchmark's own threads (2
threads on 2 cores put it near 2 on a quiet machine, and it stays there into the next
round). The verdict instead uses the CPU time the machine spent *outside this benchmark's
process tree* during the round, from ``/proc/stat`` (all CPUs, including time stolen by
the hypervisor) minus ``/proc/<pid>/stat`` of this process and its descendants (servers,
workers, clients): in cores' worth of work, ``foreign = (busy + steal - ours) / ticks /
wall``. A round is contended when that passes ``FOREIGN_CORES_LIMIT``; without ``/proc``
the fallback compares the load average measured before the round with the thread count.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "results"

from llmctl.utils.cpu_load import FOREIGN_CORES_LIMIT, foreign_cores, sample

THREAD_ENV_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "OMP_PROC_BIND",
                   "OMP_PLACES", "KMP_AFFINITY", "TOKENIZERS_PARALLELISM")


# --- the tree being measured ---------------------------------------------------------------
def changed_files(porcelain: str) -> list[str]:
    """Paths from ``git status --porcelain`` (v1: two status columns, a space, the path)."""
    return [line[3:] for line in porcelain.splitlines() if len(line) > 3]


def tree_state() -> dict[str, Any]:
    """HEAD and whether tracked files differ from it (untracked files do not count)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              timeout=10, check=False).stdout

    commit = git("rev-parse", "HEAD").strip() or None
    changed = changed_files(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": commit, "dirty": bool(changed), "changed_files": changed,
            "describe": f"{commit}-dirty" if changed else commit}


def writes_results(out: Path | str | None) -> bool:
    """Whether ``out`` (a file or directory) lies under this repository's ``results/``."""
    if out is None:
        return False
    out = Path(out).resolve()
    return out == RESULTS.resolve() or RESULTS.resolve() in out.parents


def refuse_dirty(state: dict[str, Any], allow_dirty: bool, out: Path | str | None = None,
                 ) -> None:
    """Stop before measuring anything when results/ would get numbers from a tree with
    uncommitted changes (exit 2). Elsewhere (a smoke run into /tmp) the output is only
    marked DIRTY. ``out=None``: refuse wherever the output goes."""
    if out is not None and not writes_results(out):
        return
    if state["dirty"] and not allow_dirty:
        files = ", ".join(state["changed_files"][:5])
        print(f"error: the tree has uncommitted changes ({files}): results must name a commit; "
              "commit or stash them, or pass --allow-dirty (the output is then marked DIRTY)",
              file=sys.stderr)
        raise SystemExit(2)


# --- the machine ---------------------------------------------------------------------------
def cpus() -> list[int]:
    """The CPUs this process may run on (what a child inherits)."""
    return sorted(os.sched_getaffinity(0))


def cpu_flags() -> dict[str, bool]:
    """The instruction-set features that pick oneDNN/vLLM kernels (AMX vs AVX-512 BF16)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return {name: name in flags for name in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni",
                                             "amx_bf16", "amx_tile")}


def thread_env(threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The child environment with thread pools sized deliberately (torch/OpenMP/MKL)."""
    env = dict(os.environ if base is None else base)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false")
    return env


def python_versions(python: str, packages: Sequence[str]) -> dict[str, str | None]:
    """Installed versions of ``packages`` as another interpreter (a venv) sees them."""
    code = ("import json, sys\nfrom importlib.metadata import version, PackageNotFoundError\n"
            "out = {'python': sys.version.split()[0]}\n"
            "for name in sys.argv[1:]:\n"
            "    try: out[name] = version(name)\n"
            "    except PackageNotFoundError: out[name] = None\n"
            "print(json.dumps(out))")
    try:
        proc = subprocess.run([python, "-c", code, *packages], capture_output=True, text=True,
                              timeout=120, check=False)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return {"error": f"could not query {python}"}


# --- contention (the sampling lives in llmctl.utils.cpu_load, shared with hw probe) ------
def is_contended(foreign: float | None, load_before: float, threads: int) -> bool:
    """The verdict on one round (see the module docstring for why not the load average)."""
    if foreign is not None:
        return foreign > FOREIGN_CORES_LIMIT
    # fallback without /proc: before the round our own threads are idle, so a load above
    # the thread count means someone else's work (this still lags by a minute)
    return load_before > threads


@contextlib.contextmanager
def measured_round(record: dict[str, Any], threads: int) -> Iterator[dict[str, Any]]:
    """Fill ``record`` with load before/after, wall time and the contention verdict."""
    before = sample()
    load_before = os.getloadavg()
    wall0 = time.perf_counter()
    yield record
    after = sample()
    foreign = (foreign_cores(before, after, os.sysconf("SC_CLK_TCK"))
               if before is not None and after is not None else None)
    record.update(load_before=[round(x, 2) for x in load_before],
                  load_after=[round(x, 2) for x in os.getloadavg()],
                  round_wall_s=round(time.perf_counter() - wall0, 3),
                  foreign_cpu_cores=None if foreign is None else round(foreign, 3),
                  contended=is_contended(foreign, load_before[0], threads))


# --- the report ----------------------------------------------------------------------------
def median(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def start_run(benchmark: str, config: dict[str, Any], *, allow_dirty: bool, threads: int,
              out: Path | str | None,
              extra_pythons: dict[str, tuple[str, Sequence[str]]] | None = None
              ) -> dict[str, Any]:
    """The report's frame, taken before measuring; refuses a dirty tree when the report
    goes under results/ (exit 2), marks it DIRTY elsewhere."""
    from llmctl.report import run_metadata

    state = tree_state()
    refuse_dirty(state, allow_dirty, out)
    meta = run_metadata(benchmark=benchmark)
    meta["machine"].update(cpus_allowed=cpus(), cpu_flags=cpu_flags())
    meta["thread_env"] = {k: os.environ.get(k) for k in THREAD_ENV_KEYS}
    for name, (python, packages) in (extra_pythons or {}).items():
        meta["versions"][name] = python_versions(python, packages)
    return {"benchmark": benchmark,
            "command": shlex.join([Path(sys.executable).name, *sys.argv]),
            "python": sys.executable, "tree": state, "dirty": state["dirty"],
            "threads": threads, "config": config, "metadata": meta,
            "load_start": [round(x, 2) for x in os.getloadavg()]}


def finish_run(report: dict[str, Any], rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Close the frame: the tree again (edits during the run count), load, contention."""
    end = tree_state()
    report["tree_end"] = end
    report["dirty"] = bool(report["tree"]["dirty"] or end["dirty"]
                           or end["commit"] != report["tree"]["commit"])
    report["load_end"] = [round(x, 2) for x in os.getloadavg()]
    flagged = [r.get("name", str(i)) for i, r in enumerate(rounds) if r.get("contended")]
    report["contended_rounds"] = flagged
    report["contended"] = bool(flagged)
    return report


def header_markdown(report: dict[str, Any], title: str) -> list[str]:
    meta = report["metadata"]
    machine = meta["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items()
                         if isinstance(v, str))
    lines = [f"# {title}", ""]
    if report["dirty"]:
        lines += [("**DIRTY TREE: these numbers do not belong to any commit "
                   f"({report['tree']['describe']}); regenerate from a committed tree.**"), ""]
    lines += [f"Command: `{report['command']}`", "",
              (f"Date {meta['date']}, commit {report['tree']['describe']}; "
               f"{machine['cpu']}, {machine['cores']} cores (allowed "
               f"{machine['cpus_allowed']}), {report['threads']} threads; {versions}."),
              (f"Load average (1/5/15 min) at start {report['load_start']}, at end "
               f"{report['load_end']}; per round in the table/JSON.")]
    if report["contended"]:
        lines.append(f"**Contended: other processes used more than {FOREIGN_CORES_LIMIT} "
                     f"cores during {', '.join(report['contended_rounds'])}; those numbers "
                     "are low and noisy.**")
    else:
        lines.append(f"No round saw more than {FOREIGN_CORES_LIMIT} cores of other work.")
    return lines + [""]


def write_report(out_dir: Path, stem: str, report: dict[str, Any], markdown: str) -> Path:
    """``<stem>.json`` and ``<stem>.md`` in ``out_dir``, each replaced atomically."""
    from llmctl.utils.atomic import write_text

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text(out_dir / f"{stem}.json", json.dumps(report, indent=2, default=str) + "\n")
    write_text(out_dir / f"{stem}.md", markdown)
    return out_dir / f"{stem}.json"


def add_run_arguments(parser) -> None:
    """The options every script shares."""
    parser.add_argument("--allow-dirty", action="store_true",
                        help="write results/ from an uncommitted tree anyway (the output "
                             "says DIRTY)")
    parser.add_argument("--out-dir", default=str(RESULTS))


def fmt(value, spec: str) -> str:
    """``value`` formatted for a Markdown table; ``?`` when it was not measured."""
    return "?" if value is None else format(value, spec)


def add_workload_arguments(parser, *, num_prompts: int, input_len: int, output_len: int,
                           cpus_help: str = "CPU list (default: all this process may use)"
                           ) -> None:
    """The model, rounds, random-workload shape, seed, CPUs and label options that the
    A/B scripts share (``--cpus`` is read back with :func:`cpu_list`)."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--input-len", type=int, default=input_len)
    parser.add_argument("--output-len", type=int, default=output_len)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpus", default=None, help=cpus_help)
    parser.add_argument("--label", default="smollm2")


def cpu_list(arg: str | None) -> tuple[int, ...]:
    """``--cpus 0,1`` as a tuple; every CPU this process may use when not given."""
    return tuple(int(c) for c in arg.split(",")) if arg else tuple(cpus())


def ab_throughput(runs: Sequence[dict[str, Any]], rounds: int, sides: tuple[str, str],
                  ratio_key: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """An alternating A/B run's output throughput: ``sides[0] / sides[1]`` within each
    round where both sides succeeded (``ratio_key``), and the medians over rounds of
    each side and of that ratio (other sides in ``runs`` are ignored). ``runs``: records with ``round``, ``side`` and a
    ``result`` holding ``output_throughput``; a record with an ``error`` is left out."""
    a, b = sides
    ok = [r for r in runs if "result" in r and "error" not in r]
    per_round = []
    for rnd in range(1, rounds + 1):
        got = {r["side"]: r["result"]["output_throughput"] for r in ok
               if r["round"] == rnd and r["side"] in sides}
        if set(got) == set(sides) and got[b]:
            per_round.append({"round": rnd, ratio_key: got[a] / got[b]})
    summary: dict[str, Any] = {side: {"output_throughput": median(
        [r["result"]["output_throughput"] for r in ok if r["side"] == side])}
        for side in sides}
    summary[ratio_key] = median([p[ratio_key] for p in per_round])
    return per_round, summary


def rotation(sides: Sequence[str], rnd: int) -> list[str]:
    """Round ``rnd``'s order (from 1): it starts with side ``rnd`` of ``sides``, so over
    ``len(sides)`` rounds every side runs in every position once."""
    shift = (rnd - 1) % len(sides)
    return list(sides[shift:]) + list(sides[:shift])


def against_base(runs: Sequence[dict[str, Any]], rounds: int, others: Sequence[str],
                 base: str, key: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """:func:`ab_throughput` of every side in ``others`` against ``base``, merged: one
    row per round holding each side's ratio (``key.format(side)``), one summary."""
    by_round: dict[int, dict[str, Any]] = {}
    summary: dict[str, Any] = {}
    for side in others:
        rows, part = ab_throughput(runs, rounds, (side, base), key.format(side))
        for row in rows:
            by_round.setdefault(row["round"], {"round": row["round"]}).update(row)
        summary.update(part)
    return [by_round[r] for r in sorted(by_round)], summary


def ab_markdown(per_round: Sequence[dict[str, Any]], summary: dict[str, Any],
                sides: Sequence[tuple[str, str]], ratios: Sequence[tuple[str, str]]) -> list[str]:
    """:func:`ab_throughput`'s output as markdown: a table of each round's ratios and a
    line of the medians. ``sides``: (side, label) pairs; ``ratios``: (ratio key,
    "a / b") pairs, as the table heads name them."""
    lines = ["| round | " + " | ".join(f"output tok/s {name}" for _, name in ratios) + " |",
             "|---|" + "---|" * len(ratios)]
    lines += [f"| {p['round']} | " + " | ".join(fmt(p.get(key), ".3f") for key, _ in ratios)
              + " |" for p in per_round]
    medians = ", ".join(f"{fmt(summary[side]['output_throughput'], '.1f')} {label}"
                        for side, label in sides)
    ratio_text = "; ".join(f"{name.replace(' ', '')} {fmt(summary[key], '.3f')}"
                           for key, name in ratios)
    return lines + ["", f"Median over rounds (output tok/s): {medians}; {ratio_text}."]
