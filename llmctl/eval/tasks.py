"""Multiple-choice tasks scored by log-likelihood, the way lm-evaluation-harness does.

A task is a JSONL file of ``{"query", "choices", "gold"}`` items: the built-in sets in
``llmctl/eval/taskdata/`` (``--tasks builtin`` or a name), or any file with that
shape (``--tasks path/to/items.jsonl``). Each choice is the continuation
``" " + choice`` after the query; tokenization follows lm-evaluation-harness
(encode ``context + continuation`` with the tokenizer's defaults and split at the
length of the encoded context; trailing spaces of the context move to the
continuation).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llmctl.errors import ConfigError
from llmctl.eval.generative import (
    GenTask,
    is_generative,
    parse_items,
    read_jsonl,
    score_generative,
)

TASK_DIR = Path(__file__).resolve().parent / "taskdata"
GENERATIVE_DIR = TASK_DIR / "generative"
TARGET_DELIMITER = " "


@dataclass(frozen=True)
class MCItem:
    id: str
    query: str
    choices: list[str]
    gold: int


@dataclass(frozen=True)
class MCTask:
    name: str
    items: list[MCItem]
    path: Path

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


@dataclass
class TaskResult:
    name: str
    n: int
    acc: float
    acc_norm: float
    source: str  # "llmctl" | "lm_eval"
    details: dict[str, Any] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        se = lambda p: math.sqrt(p * (1 - p) / (self.n - 1)) if self.n > 1 else 0.0
        return {f"task.{self.name}.acc": self.acc, f"task.{self.name}.acc_se": se(self.acc),
                f"task.{self.name}.acc_norm": self.acc_norm,
                f"task.{self.name}.acc_norm_se": se(self.acc_norm),
                f"task.{self.name}.n": self.n}

    def counts(self) -> dict[str, int]:
        return {f"task.{self.name}.acc": self.n, f"task.{self.name}.acc_norm": self.n}

    def report_entry(self) -> dict[str, Any]:
        """The task's block in an eval report; ``items`` (id, acc and acc_norm as 0/1, ...)
        is what paired ``delta(...)`` gates compare item by item (None for lm-eval tasks)."""
        return {"n": self.n, "acc": self.acc, "acc_norm": self.acc_norm, "source": self.source,
                **{k: v for k, v in self.details.items() if k != "items"},
                "items": self.details.get("items")}


def builtin_task_names() -> list[str]:
    return sorted(p.stem for p in TASK_DIR.glob("*.jsonl"))


def expand_task_names(spec: list[str]) -> list[str]:
    """``builtin`` expands to every built-in set; other names pass through."""
    names: list[str] = []
    for item in spec:
        for name in (n.strip() for n in item.split(",")):
            if not name:
                continue
            for expanded in (builtin_task_names() if name == "builtin" else [name]):
                if expanded not in names:
                    names.append(expanded)
    return names


def task_metric_name(name: str) -> str:
    """What a task is called in metric keys (``task.NAME.acc``)."""
    if name.startswith("lm_eval:"):
        return name.split(":", 1)[1]
    path = Path(name)
    return path.stem if path.suffix == ".jsonl" else name


def generative_task_names() -> list[str]:
    return sorted(p.stem for p in GENERATIVE_DIR.glob("*.jsonl"))


def load_task(name: str) -> MCTask | GenTask:
    """A built-in set by name (multiple-choice or generative) or a JSONL file, whose
    first item's shape says which kind it is."""
    path = TASK_DIR / f"{name}.jsonl"
    if not path.is_file():
        path = GENERATIVE_DIR / f"{name}.jsonl"
    if not path.is_file():
        path = Path(name).expanduser()
        if path.suffix != ".jsonl" or not path.is_file():
            raise ConfigError(f"unknown task {name!r}",
                              f"built-in tasks: {', '.join(builtin_task_names())} (or 'builtin'); "
                              f"generative: {', '.join(generative_task_names())}; a JSONL file "
                              "of {query, choices, gold} or {prompt, answer}; or lm_eval:NAME")
    lines = read_jsonl(path)
    if lines and is_generative(lines[0][1]):
        return GenTask(task_metric_name(name), parse_items(path, lines), path)
    items = []
    for lineno, raw in lines:
        try:
            item = MCItem(str(raw.get("id", f"{path.stem}-{lineno}")), str(raw["query"]),
                          [str(c) for c in raw["choices"]], int(raw["gold"]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{path}:{lineno} is not a task item ({exc})",
                              'each line needs {"query": str, "choices": [str], "gold": int}') from None
        if not 0 <= item.gold < len(item.choices) or len(item.choices) < 2:
            raise ConfigError(f"{path}:{lineno}: gold {item.gold} does not index {len(item.choices)} choices",
                              "gold is the 0-based index of the right choice")
        items.append(item)
    if not items:
        raise ConfigError(f"{path} has no items", "add JSONL lines")
    return MCTask(task_metric_name(name), items, path)


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's split of (context, continuation) into token ids."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    # The tokenizer's own defaults, as lm-evaluation-harness: BOS if it adds one.
    whole = tokenizer(context + continuation)["input_ids"]
    ctx = tokenizer(context)["input_ids"]
    return whole[:len(ctx)], whole[len(ctx):]


def choice_scores(candidate, item: MCItem) -> list[float]:
    pairs = []
    for choice in item.choices:
        ctx, cont = encode_pair(candidate.tokenizer, item.query, TARGET_DELIMITER + choice)
        if not ctx:
            tok = candidate.tokenizer
            ctx = [tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id]
        pairs.append((ctx, cont))
    return [ll for ll, _ in candidate.loglikelihoods(pairs)]


def score_task(candidate, task: MCTask | GenTask, limit: int | None = None,
               progress=None, *, max_tokens: int = 256, thinking: bool = True) -> TaskResult:
    """Multiple-choice by log-likelihood; a generative task by its answers
    (:func:`llmctl.eval.generative.score_generative`, ``max_tokens`` and ``thinking``)."""
    if isinstance(task, GenTask):
        return score_generative(candidate, task, limit, progress, max_tokens=max_tokens,
                                thinking=thinking)
    items = task.items[:limit] if limit else task.items
    correct = correct_norm = 0
    per_item = []
    for i, item in enumerate(items):
        lls = np.asarray(choice_scores(candidate, item))
        lengths = np.asarray([float(len(c)) for c in item.choices])
        pred, pred_norm = int(np.argmax(lls)), int(np.argmax(lls / lengths))
        correct += pred == item.gold
        correct_norm += pred_norm == item.gold
        per_item.append({"id": item.id, "acc": int(pred == item.gold),
                         "acc_norm": int(pred_norm == item.gold), "pred": pred,
                         "pred_norm": pred_norm, "gold": item.gold,
                         "loglikelihoods": [round(float(x), 5) for x in lls]})
        if progress:
            progress(i + 1, len(items))
    n = len(items)
    return TaskResult(task.name, n, correct / n, correct_norm / n, "llmctl",
                      {"path": str(task.path), "sha256": task.sha256, "items": per_item})


def lm_eval_task_yaml(task: MCTask, name: str | None = None) -> str:
    """A task YAML that makes lm-evaluation-harness run the same items offline."""
    return "\n".join([
        f"task: {name or task.name.replace('-', '_')}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {task.path.resolve()}",
        "test_split: test",
        "output_type: multiple_choice",
        'doc_to_text: "{{query}}"',
        'doc_to_choice: "{{choices}}"',
        'doc_to_target: "{{gold}}"',
        "metric_list:",
        "  - metric: acc",
        "    aggregation: mean",
        "    higher_is_better: true",
        "  - metric: acc_norm",
        "    aggregation: mean",
        "    higher_is_better: true",
        "",
    ])
