"""Workloads: lists of prompts with their token lengths, built from a seed.

Token lengths are counted with the model's own tokenizer. Every loader is registered in
``DATASETS`` by name; an unknown name lists the known ones.

- ``random``: random vocabulary tokens, lengths fixed or normal(mean, std);
- ``sharegpt``: ShareGPT-format JSON (first user turn -> prompt, the reply's length ->
  output length unless ``--output-len``), filtered like vLLM (4 <= prompt <= 1024 tokens,
  prompt + output <= 2048);
- ``jsonl``: local prompts (``.jsonl`` field, ``.txt``, ``.parquet``, ``hf:``, ``builtin:``);
- ``prefix``: N shared system prompts x M questions, shuffled (prefix caching);
- ``long-context``: windows of real prose (default the held-out pydoc text) plus a question;
- ``multi-turn``: conversations of ``turns`` user messages of random vocabulary, each turn
  sent with the history (:mod:`llmctl.bench.conversations`);
- ``trace``: a JSONL request trace replayed on its own clock (:mod:`llmctl.bench.trace`:
  Mooncake's format, shared prefixes from its hash ids).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from llmctl.bench.records import SampleRequest
from llmctl.errors import ConfigError, ModelNotFoundError, UsageError

DATASETS: dict[str, Callable[[DatasetSpec, object, np.random.Generator], list[SampleRequest]]] = {}
# Defaults per workload when --input-len/--output-len are not given (tokens).
DEFAULT_LENGTHS = {"random": (256, 128), "sharegpt": (None, None), "jsonl": (None, 128),
                   "prefix": (64, 64), "long-context": (4096, 64), "multi-turn": (64, 64)}
LONG_CONTEXT_QUESTION = "\n\nSummarize the text above in one paragraph."


class DatasetSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "random"
    path: str | None = None
    prompt_field: str = "prompt"
    num_prompts: int = Field(100, ge=1)
    input_len: int | None = Field(None, ge=1)
    input_len_std: float = Field(0.0, ge=0)
    output_len: int | None = Field(None, ge=1)
    output_len_std: float = Field(0.0, ge=0)
    num_prefixes: int = Field(4, ge=1)
    prefix_len: int = Field(256, ge=1)
    questions_per_prefix: int | None = Field(None, ge=1)
    turns: int = Field(3, ge=1)  # multi-turn: user messages per conversation
    think_time: float = Field(0.0, ge=0)  # multi-turn: seconds from an answer to the next turn
    trace_block_tokens: int = Field(512, ge=1)  # trace: tokens per hash id (Mooncake: 512)
    trace_time_scale: float = Field(1.0, gt=0)  # trace: replay speed (2 = twice as fast)
    seed: int = 0

    def lengths(self) -> tuple[int | None, int | None]:
        default_in, default_out = DEFAULT_LENGTHS.get(self.name, (None, None))
        return self.input_len or default_in, self.output_len or default_out


def register(name: str):
    def wrap(fn):
        DATASETS[name] = fn
        return fn
    return wrap


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _draw_lengths(mean: int, std: float, n: int, rng: np.random.Generator) -> list[int]:
    """Fixed lengths, or normal(mean, std) rounded and clipped to >= 1."""
    if std <= 0:
        return [int(mean)] * n
    return [max(1, round(x)) for x in rng.normal(mean, std, size=n)]


def _token_pool(tok) -> np.ndarray:
    """Ids that decode to visible, self-contained text: no specials, no partial bytes."""
    cached = getattr(tok, "_llmctl_bench_pool", None)
    if cached is not None:
        return cached
    special = set(tok.all_special_ids)
    ids = [i for i in range(len(tok)) if i not in special]
    texts = tok.batch_decode([[i] for i in ids])
    pool = np.array([i for i, t in zip(ids, texts)
                     if t.strip() and t.isprintable() and "\ufffd" not in t], dtype=np.int64)
    if len(pool) == 0:
        raise ConfigError("the tokenizer has no printable tokens to build random prompts",
                          "use --dataset jsonl with your own prompts")
    try:
        tok._llmctl_bench_pool = pool
    except AttributeError:
        pass
    return pool


def random_text(tok, n_tokens: int, rng: np.random.Generator) -> tuple[str, int]:
    """Text of (almost always) exactly ``n_tokens`` tokens of random vocabulary.

    Decoding then re-encoding is not the identity for BPE (neighbours merge), so the
    text is trimmed or extended until the count matches; returns the final count.
    """
    pool = _token_pool(tok)
    text = tok.decode(rng.choice(pool, size=n_tokens).tolist())
    count = len(_encode(tok, text))
    for _ in range(8):
        if count == n_tokens:
            break
        if count > n_tokens:
            text = tok.decode(_encode(tok, text)[:n_tokens])
        else:
            text = text + " " + tok.decode(rng.choice(pool, size=n_tokens - count).tolist())
        count = len(_encode(tok, text))
    return text, count


@register("random")
def _random(spec: DatasetSpec, tok, rng: np.random.Generator) -> list[SampleRequest]:
    input_len, output_len = spec.lengths()
    ins = _draw_lengths(input_len, spec.input_len_std, spec.num_prompts, rng)
    outs = _draw_lengths(output_len, spec.output_len_std, spec.num_prompts, rng)
    samples = []
    for n_in, n_out in zip(ins, outs):
        text, count = random_text(tok, n_in, rng)
        samples.append(SampleRequest(text, count, n_out))
    return samples


def _turns(entry: dict) -> list[tuple[str, str]]:
    turns = entry.get("conversations") or entry.get("conversation") or entry.get("messages")
    if not isinstance(turns, list):
        return []
    out = []
    for turn in turns:
        if isinstance(turn, dict):
            role = turn.get("from", turn.get("role", ""))
            text = turn.get("value", turn.get("content", ""))
            if isinstance(text, str):
                out.append((str(role).lower(), text))
    return out


@register("sharegpt")
def _sharegpt(spec: DatasetSpec, tok, rng: np.random.Generator) -> list[SampleRequest]:
    if not spec.path:
        raise UsageError("--dataset sharegpt needs --dataset-path FILE.json",
                         "pass a ShareGPT-format JSON file (a list of {conversations: [...]})")
    path = Path(spec.path).expanduser()
    if not path.is_file():
        raise ModelNotFoundError(f"no ShareGPT file at {path}", "check --dataset-path")
    try:
        text = path.read_text(encoding="utf-8")
        entries = (json.loads(text) if path.suffix != ".jsonl"
                   else [json.loads(line) for line in text.splitlines() if line.strip()])
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}", "pass a ShareGPT JSON file") from None
    if not isinstance(entries, list):
        raise ConfigError(f"{path} must hold a JSON list of conversations",
                          "ShareGPT format: [{\"conversations\": [{\"from\": \"human\", ...}]}]")
    order = rng.permutation(len(entries))
    samples: list[SampleRequest] = []
    for i in order:
        turns = _turns(entries[i]) if isinstance(entries[i], dict) else []
        if len(turns) < 2 or turns[0][0] not in ("human", "user"):
            continue
        prompt, reply = turns[0][1], turns[1][1]
        prompt_len = len(_encode(tok, prompt))
        output_len = spec.output_len or len(_encode(tok, reply))
        # vLLM's filter: drop tiny exchanges and ones too long for small-context models.
        if prompt_len < 4 or output_len < 4 or prompt_len > 1024 \
                or prompt_len + output_len > 2048:
            continue
        samples.append(SampleRequest(prompt, prompt_len, output_len))
        if len(samples) == spec.num_prompts:
            break
    if not samples:
        raise ConfigError(f"{path} has no usable conversation",
                          "each needs a human turn then a reply, 4..1024 prompt tokens")
    return samples


@register("jsonl")
def _jsonl(spec: DatasetSpec, tok, rng: np.random.Generator) -> list[SampleRequest]:
    from llmctl.data.sources import load_text_source

    if not spec.path:
        raise UsageError("--dataset jsonl needs --dataset-path",
                         "pass a .jsonl (with --prompt-field), .txt, .parquet, hf:NAME or "
                         "builtin:NAME source of prompts")
    prompts = load_text_source(spec.path, spec.prompt_field).texts
    _, output_len = spec.lengths()
    outs = _draw_lengths(output_len, spec.output_len_std, spec.num_prompts, rng)
    # File order, cycled when more prompts are asked for than the file holds.
    chosen = [prompts[i % len(prompts)] for i in range(spec.num_prompts)]
    return [SampleRequest(p, len(_encode(tok, p)), n) for p, n in zip(chosen, outs)]


def join_prefix(system: str | None, prompt: str) -> str:
    """How completions endpoints see a shared prefix: prepended with a blank line."""
    return prompt if not system else f"{system}\n\n{prompt}"


@register("prefix")
def _prefix(spec: DatasetSpec, tok, rng: np.random.Generator) -> list[SampleRequest]:
    input_len, output_len = spec.lengths()
    per_prefix = spec.questions_per_prefix or math.ceil(spec.num_prompts / spec.num_prefixes)
    total = spec.num_prefixes * per_prefix if spec.questions_per_prefix else spec.num_prompts
    prefixes = [random_text(tok, spec.prefix_len, rng)[0] for _ in range(spec.num_prefixes)]
    samples = []
    for k in range(spec.num_prefixes * per_prefix):
        system = prefixes[k // per_prefix]
        question, _ = random_text(tok, input_len, rng)
        count = len(_encode(tok, join_prefix(system, question)))
        samples.append(SampleRequest(question, count, output_len, system=system))
    order = rng.permutation(len(samples))[:total]
    return [samples[i] for i in order]


@register("long-context")
def _long_context(spec: DatasetSpec, tok, rng: np.random.Generator) -> list[SampleRequest]:
    from llmctl.data.sources import load_text_source, token_stream

    input_len, output_len = spec.lengths()
    ids = token_stream(tok, load_text_source(spec.path or "builtin:pydoc-heldout",
                                             spec.prompt_field))
    question_len = len(_encode(tok, LONG_CONTEXT_QUESTION))
    window = max(1, input_len - question_len)
    if len(ids) < window:
        raise ConfigError(f"the text has {len(ids)} tokens, fewer than one window of {window}",
                          "use a longer --dataset-path text or a shorter --input-len")
    outs = _draw_lengths(output_len, spec.output_len_std, spec.num_prompts, rng)
    eos = tok.eos_token_id
    samples = []
    for n_out in outs:
        start = int(rng.integers(0, len(ids) - window + 1))
        body = [t for t in ids[start:start + window] if t != eos]
        prompt = tok.decode(body) + LONG_CONTEXT_QUESTION
        samples.append(SampleRequest(prompt, len(_encode(tok, prompt)), n_out))
    return samples


@register("multi-turn")
def _multi_turn(spec: DatasetSpec, tok, rng: np.random.Generator) -> list[SampleRequest]:
    """``num_prompts`` conversations (their first turns; the runner sends the rest)."""
    from llmctl.bench.conversations import Conversation

    input_len, output_len = spec.lengths()
    firsts = []
    for _ in range(spec.num_prompts):
        ins = _draw_lengths(input_len, spec.input_len_std, spec.turns, rng)
        outs = _draw_lengths(output_len, spec.output_len_std, spec.turns, rng)
        turns = []
        for n_in, n_out in zip(ins, outs):
            text, count = random_text(tok, n_in, rng)
            turns.append(SampleRequest(text, count, n_out))
        firsts.append(Conversation(tuple(turns), spec.think_time).first())
    return firsts


@register("trace")
def _trace(spec: DatasetSpec, tok, rng: np.random.Generator) -> list[SampleRequest]:
    from llmctl.bench import trace

    if not spec.path:
        raise UsageError("--dataset trace needs --dataset-path",
                         "pass a JSONL trace (timestamp, input_length, output_length, hash_ids)")
    requests = trace.read_trace(spec.path)[:spec.num_prompts]
    blocks: dict[tuple, str] = {}

    def block_text(key: tuple[int, ...], n_tokens: int) -> str:
        if (key, n_tokens) not in blocks:  # the same id: the same text, in every request
            own = np.random.default_rng([spec.seed, n_tokens, *(k + 2 for k in key)])
            blocks[key, n_tokens] = random_text(tok, n_tokens, own)[0]
        return blocks[key, n_tokens]

    arrivals = trace.arrivals(requests, spec.trace_time_scale)
    samples = []
    for i, (req, at) in enumerate(zip(requests, arrivals)):
        prompt = trace.prompt_text(req, i, spec.trace_block_tokens, block_text)
        samples.append(SampleRequest(prompt, len(_encode(tok, prompt)), req.output_length,
                                     arrival=at))
    return samples


def build_dataset(spec: DatasetSpec, tokenizer) -> list[SampleRequest]:
    """The workload for ``spec``; the same seed gives the same prompts."""
    try:
        loader = DATASETS[spec.name]
    except KeyError:
        raise UsageError(f"unknown dataset {spec.name!r}",
                         f"known datasets: {', '.join(DATASETS)}") from None
    input_len, _ = spec.lengths()
    if spec.name in ("random", "prefix", "long-context", "multi-turn") and input_len is None:
        raise UsageError(f"--dataset {spec.name} needs --input-len", "e.g. --input-len 256")
    return loader(spec, tokenizer, np.random.default_rng(spec.seed))


def fingerprint(samples: list[SampleRequest]) -> str:
    """SHA-256 over the prompts and lengths: equal fingerprints, equal workloads."""
    digest = hashlib.sha256()
    for s in samples:
        turns = s.conversation.turns[1:] if s.conversation is not None else ()
        digest.update(json.dumps([s.system, s.prompt, s.prompt_len, s.output_len]
                                 + ([s.arrival] if s.arrival is not None else [])
                                 + [[t.prompt, t.output_len] for t in turns]).encode())
    return digest.hexdigest()
