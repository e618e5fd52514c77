"""Generative tasks: a prompt, a greedy answer, an exact or numeric match, with the
reasoning of a thinking model (Qwen3, DeepSeek-R1 distills, gpt-oss) taken out first.

A task is a JSONL file of ``{"prompt", "answer"}`` items (``"match"``: ``"number"``, the
last number in the answer equals the gold one, or ``"exact"``, the answer equals it up to
case, surrounding space and a final full stop), sent as one user message through the
candidate's chat template. The built-in sets live in ``taskdata/generative/`` and run by
name (``--tasks arith-gen``; ``builtin`` is the multiple-choice sets).

Reasoning: a server started with a reasoning parser returns the thinking in its own field
and the answer in ``content``; without a parser (or from a local model) the text is split
here at ``<think>``/``</think>`` (``</think>`` alone: the template opened the thinking).
An answer that never left the thinking (the token budget ran out inside it) scores 0 and
is counted (``ended_in_thinking``), as is every answer that had reasoning taken out.
``thinking=False`` asks the template to switch thinking off (``enable_thinking: false``,
Qwen3's switch) instead.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from llmctl.errors import ConfigError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
MATCHES = ("number", "exact")


@dataclass(frozen=True)
class Generation:
    """What a candidate wrote for one prompt: the text, the reasoning a server already
    separated (None: it separated none), and why it stopped ("stop" | "length")."""

    text: str
    reasoning: str | None
    finish_reason: str


@dataclass(frozen=True)
class GenItem:
    id: str
    prompt: str
    answer: str
    match: str = "exact"


@dataclass(frozen=True)
class GenTask:
    name: str
    items: list[GenItem]
    path: Path

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


def is_generative(first_line: dict) -> bool:
    return "prompt" in first_line and "choices" not in first_line


def parse_items(path: Path, lines: list[tuple[int, dict]]) -> list[GenItem]:
    items = []
    for lineno, raw in lines:
        try:
            item = GenItem(str(raw.get("id", f"{path.stem}-{lineno}")), str(raw["prompt"]),
                           str(raw["answer"]), str(raw.get("match", "exact")))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{path}:{lineno} is not a generative task item ({exc})",
                              'each line needs {"prompt": str, "answer": str}') from None
        if item.match not in MATCHES:
            raise ConfigError(f"{path}:{lineno}: match {item.match!r} is not one of "
                              f"{', '.join(MATCHES)}", "use number or exact")
        items.append(item)
    return items


def split_reasoning(generation: Generation) -> tuple[str, bool, bool]:
    """``(answer, had_reasoning, ended_in_thinking)`` of one generation."""
    text = generation.text or ""
    if generation.reasoning:  # the server split it: content is the answer
        ended = not text.strip() and generation.finish_reason == "length"
        return text, True, ended
    if THINK_CLOSE in text:
        return text.rsplit(THINK_CLOSE, 1)[1], True, False
    if THINK_OPEN in text:  # opened and never closed
        return "", True, True
    return text, False, False


def _numbers(text: str) -> list[float]:
    out = []
    for match in _NUMBER.findall(text):
        try:
            out.append(float(match.replace(",", "")))
        except ValueError:
            continue
    return out


def prediction(answer: str, match: str) -> str | None:
    """What an answer is taken to say: its last number, or its normalised text."""
    if match == "number":
        numbers = _numbers(answer)
        return None if not numbers else format(numbers[-1], "g")
    return answer.strip().rstrip(".").strip().casefold() or None


def is_correct(answer: str, item: GenItem) -> bool:
    got = prediction(answer, item.match)
    return got is not None and got == prediction(item.answer, item.match)


def score_generative(candidate, task: GenTask, limit: int | None = None, progress=None, *,
                     max_tokens: int = 256, thinking: bool = True):
    """Greedy answers through ``candidate.chat``; a :class:`~llmctl.eval.tasks.TaskResult`
    whose ``acc`` (and ``acc_norm``, the same number: one answer per item) is the share
    matched, with ``ended_in_thinking`` and ``reasoning_stripped`` counts."""
    from llmctl.eval.tasks import TaskResult

    items = task.items[:limit] if limit else task.items
    per_item, correct, ended, stripped = [], 0, 0, 0
    for i, item in enumerate(items):
        out = candidate.chat([{"role": "user", "content": item.prompt}], max_tokens,
                             thinking=thinking)
        answer, had, in_thinking = split_reasoning(out)
        ok = not in_thinking and is_correct(answer, item)
        correct += ok
        ended += in_thinking
        stripped += had
        per_item.append({"id": item.id, "acc": int(ok), "acc_norm": int(ok),
                         "pred": prediction(answer, item.match), "gold": item.answer,
                         "finish_reason": out.finish_reason,
                         "ended_in_thinking": in_thinking, "reasoning": had,
                         "answer": answer.strip()[:200]})
        if progress:
            progress(i + 1, len(items))
    n = len(items)
    return TaskResult(task.name, n, correct / n, correct / n, "llmctl", {
        "kind": "generative", "path": str(task.path), "sha256": task.sha256,
        "thinking": thinking, "max_tokens": max_tokens, "ended_in_thinking": ended,
        "reasoning_stripped": stripped, "items": per_item})


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                raw = json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"{path}:{lineno} is not JSON ({exc})",
                                  "one JSON object per line") from None
            if not isinstance(raw, dict):
                raise ConfigError(f"{path}:{lineno} is not a JSON object",
                                  "one JSON object per line")
            out.append((lineno, raw))
    return out
