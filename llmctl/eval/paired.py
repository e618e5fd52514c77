"""Per-item outcomes of eval reports, paired between a candidate and its reference.

A task's block in a report keeps every item's id and whether the model got it right
(``acc`` and ``acc_norm`` as 0/1; reports written before those fields existed carry
``pred``, ``pred_norm`` and ``gold``, from which the same follows). A ``delta(...)``
gate needs these for both runs: the candidate's from this run's ``tasks``, the
reference's from ``reference_tasks`` (``--reference MODEL``) or from the ``tasks`` of a
``--baseline`` report. Items are matched by id; the two runs must have scored the same
items of the same task file.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from llmctl.errors import ConfigError
from llmctl.stats import PairedCounts

_TASK_METRIC = re.compile(r"^task\.(?P<task>.+)\.(?P<kind>acc|acc_norm)$")
_PRED = {"acc": "pred", "acc_norm": "pred_norm"}


def split_metric(metric: str) -> tuple[str, str] | None:
    """``task.NAME.acc`` -> ``("NAME", "acc")``; None for metrics without per-item data."""
    match = _TASK_METRIC.match(metric)
    return (match["task"], match["kind"]) if match else None


def outcomes(entry: Mapping[str, Any] | None, kind: str) -> dict[str, int] | None:
    """Item id -> 1 (right) / 0 (wrong) from a task's report block; None if it has none."""
    items = (entry or {}).get("items")
    if not items:
        return None
    out = {}
    for item in items:
        if kind in item:
            out[str(item["id"])] = int(item[kind])
        elif _PRED[kind] in item and "gold" in item:
            out[str(item["id"])] = int(item[_PRED[kind]] == item["gold"])
        else:
            return None
    return out


def pair(candidate: Mapping[str, int], reference: Mapping[str, int], task: str) -> PairedCounts:
    """Count the items each run alone got right; both must have scored the same items."""
    if candidate.keys() != reference.keys():
        only_c = len(candidate.keys() - reference.keys())
        only_r = len(reference.keys() - candidate.keys())
        raise ConfigError(
            f"task {task}: the candidate and the reference scored different items "
            f"({only_c} only in the candidate, {only_r} only in the reference)",
            "run both on the same task file with the same --task-limit")
    gains = sum(1 for k, v in candidate.items() if v and not reference[k])
    losses = sum(1 for k, v in candidate.items() if not v and reference[k])
    return PairedCounts(len(candidate), gains, losses)


def paired_counts(metrics: Iterable[str], candidate_tasks: Mapping[str, Any],
                  reference_tasks: Mapping[str, Any] | None, reference_label: str,
                  remedy: str) -> dict[str, PairedCounts]:
    """PairedCounts for each of ``metrics`` (the metrics of this run's delta gates).

    ``reference_label`` names where the reference's items come from in errors
    ("baseline FILE", "the reference run"); ``remedy`` says how to get them.
    """
    out = {}
    for metric in metrics:
        parts = split_metric(metric)
        if parts is None:
            raise ConfigError(f"{metric} has no per-item results to pair",
                              "delta(...) applies to task.NAME.acc and task.NAME.acc_norm")
        task, kind = parts
        cand_entry = candidate_tasks.get(task)
        ref_entry = (reference_tasks or {}).get(task)
        cand = outcomes(cand_entry, kind)
        if cand is None:
            raise ConfigError(f"task {task} has no per-item results in this run",
                              "lm-eval tasks report aggregates only; gate them with "
                              "wilson_low(...) instead of delta(...)")
        ref = outcomes(ref_entry, kind)
        if ref is None:
            raise ConfigError(f"{reference_label} has no per-item results for task {task}",
                              remedy)
        a, b = (cand_entry or {}).get("sha256"), (ref_entry or {}).get("sha256")
        if a and b and a != b:
            raise ConfigError(f"task {task}: this run's task file differs from the one "
                              f"{reference_label} was scored on (sha256 {a[:12]} vs {b[:12]})",
                              remedy)
        out[metric] = pair(cand, ref, task)
    return out

