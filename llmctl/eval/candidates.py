"""Candidate adapters: anything that can say how likely each next token is.

Each adapter turns one token sequence into per-row data for the metrics
(``CandidateRows``). Local models return full logits and share one path
(``logits -> candidate_rows``); an OpenAI-compatible server returns prompt
log-probs for the actual tokens and its own top-k, which is enough for perplexity,
Δp, top-1 agreement and a lumped (lower-bound) KLD.

Adapters self-register by kind (``class X(Candidate, kind="..."))``; ``open_candidate``
picks the first whose ``matches`` accepts the spec, or the kind the user forces.
"""

from __future__ import annotations

import abc
import hashlib
import importlib.util
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from llmctl.errors import ConfigError, MissingDependencyError, OfflineError
from llmctl.eval.generative import Generation
from llmctl.eval.metrics import CandidateRows

REGISTRY: dict[str, type[Candidate]] = {}


@dataclass(frozen=True)
class CandidateOptions:
    dtype: str = "float32"
    threads: int | None = None
    backend: str = "auto"  # auto | transformers | llama-cpp
    server_model: str | None = None
    server_top_logprobs: int = 20
    timeout_s: float = 600.0
    tokenizer: Any = None  # a tokenizer to use when the candidate has none (servers)
    kv_cache_dtype: str = "auto"  # the serving engine's KV cache (backend "serve")


def fingerprint_path(path: Path) -> str:
    """SHA-256 over each weight/config file's name, size and quick hash (first and
    last MiB, see llmctl.models.manifest): cheap on GB files, changes with any rewrite."""
    from llmctl.models.manifest import quick_hash

    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir()
        if p.is_file() and p.suffix in (".safetensors", ".bin", ".gguf", ".json")
        and p.name != "llmctl-manifest.json")
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.name}\0{f.stat().st_size}\0{quick_hash(f)}\n".encode())
    return digest.hexdigest()


class Candidate(abc.ABC):
    kind: ClassVar[str]
    priority: ClassVar[int] = 100  # lower is tried first by open_candidate

    def __init_subclass__(cls, kind: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if kind is not None:
            cls.kind = kind
            REGISTRY[kind] = cls

    def __init__(self, spec: str, options: CandidateOptions) -> None:
        self.spec = spec
        self.options = options

    @classmethod
    def matches(cls, spec: str) -> bool:
        return False

    # -- what every adapter provides -------------------------------------------------
    @property
    @abc.abstractmethod
    def tokenizer(self) -> Any:
        """A Hugging Face tokenizer, or an object called the same way."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """Kind, path/url and a content hash, for the report."""

    def logits(self, input_ids: list[int]):
        """``[len(input_ids), vocab]`` next-token logits (local models)."""
        raise NotImplementedError

    def rows(self, input_ids: list[int], rows: np.ndarray, targets: np.ndarray,
             reference_ids: np.ndarray | None = None) -> CandidateRows:
        from llmctl.eval.logprobs import candidate_rows

        logits = self.logits(input_ids)
        return candidate_rows(logits, rows, targets, reference_ids)

    def loglikelihood(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """log P(continuation | context) and whether greedy decoding would produce it."""
        if not context or not continuation:
            raise ConfigError("log-likelihood needs a non-empty context and continuation",
                              "prefix an empty context with the BOS/EOS token")
        ids = list(context) + list(continuation)
        rows = np.arange(len(context) - 1, len(ids) - 1, dtype=np.int64)
        targets = np.asarray(continuation, dtype=np.int64)
        got = self.rows(ids, rows, targets)
        return float(np.sum(got.target_logprob, dtype=np.float64)), bool(
            np.all(got.top1 == targets))

    def loglikelihoods(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """``loglikelihood`` for several (context, continuation) pairs; adapters batch it."""
        return [self.loglikelihood(ctx, cont) for ctx, cont in pairs]

    def chat(self, messages: list[dict], max_tokens: int, *, thinking: bool = True
             ) -> Generation:
        """A greedy answer to ``messages`` through the model's chat template (generative
        tasks); ``thinking=False`` passes ``enable_thinking: false`` to the template."""
        raise ConfigError(f"a {self.kind} candidate cannot generate answers",
                          "generative tasks run on a checkpoint (transformers or "
                          "--backend serve) or a server (openai:URL)")

    def close(self) -> None:
        pass


def chat_prompt_ids(tokenizer, messages: list[dict], thinking: bool) -> list[int]:
    """The prompt's token ids as the model's chat template writes them (no template: the
    user text alone). ``enable_thinking`` is passed only to switch thinking off, as a
    server's ``chat_template_kwargs`` would."""
    if getattr(tokenizer, "chat_template", None):
        extra = {} if thinking else {"enable_thinking": False}
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True, **extra)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer("\n".join(m["content"] for m in messages))["input_ids"]


# -- local models through transformers -----------------------------------------------


class HFCandidate(Candidate, kind="hf"):
    """An HF checkpoint dir, the embedded model, a hub id, or a GGUF imported to HF.

    compressed-tensors checkpoints (``llmctl quantize`` output) load the same way
    once the ``compressed-tensors`` package is installed.
    """

    priority = 90

    @classmethod
    def matches(cls, spec: str) -> bool:
        return True  # resolve_model decides, with its own errors

    def __init__(self, spec: str, options: CandidateOptions) -> None:
        super().__init__(spec, options)
        from llmctl.models.loading import load_tokenizer
        from llmctl.models.resolve import resolve_model

        self.resolved = resolve_model(spec)
        self.path = self.resolved.path
        self.quantization = _quantization(self.path)
        if self.quantization == "compressed-tensors" and importlib.util.find_spec(
                "compressed_tensors") is None:
            raise MissingDependencyError(
                f"{spec} is a compressed-tensors checkpoint",
                "install the quant extra: pip install 'llmctl[quant]'")
        self._tokenizer = load_tokenizer(self.path)
        self._model = None  # loaded on first use: a cached reference never needs it

    @property
    def model(self) -> Any:
        if self._model is None:
            from llmctl.models.loading import load_model

            self._model = load_model(self.path, self.options.dtype)
        return self._model

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        config = json.loads((self.path / "config.json").read_text())
        return int(config.get("vocab_size") or config["text_config"]["vocab_size"])

    def describe(self) -> dict[str, Any]:
        origin = self.resolved.origin
        return {"kind": self.kind, "reference": self.spec, "path": str(self.path),
                "source": self.resolved.source, "quantization": self.quantization,
                "sha256_quick": fingerprint_path(self.path),
                "origin": str(origin) if origin else None,
                "origin_sha256_quick": fingerprint_path(origin) if origin else None,
                "dtype": self.options.dtype}

    def logits(self, input_ids: list[int]):
        import torch

        with torch.inference_mode():
            out = self.model(torch.tensor([input_ids], dtype=torch.long), use_cache=False)
        return out.logits[0]

    def loglikelihoods(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """One right-padded forward for all pairs (a task item's choices): padding after
        a sequence does not change its causal logits, and 30 small forwards cost 4x more
        than one batched one on CPU."""
        import torch

        from llmctl.eval.logprobs import candidate_rows

        if len(pairs) == 1 or any(not c or not x for c, x in pairs):
            return super().loglikelihoods(pairs)
        seqs = [list(c) + list(x) for c, x in pairs]
        pad = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(seqs), max(map(len, seqs))), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, seq in enumerate(seqs):
            ids[b, :len(seq)] = torch.tensor(seq)
            mask[b, :len(seq)] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out = []
        for b, (ctx, cont) in enumerate(pairs):
            rows = np.arange(len(ctx) - 1, len(ctx) + len(cont) - 1, dtype=np.int64)
            targets = np.asarray(cont, dtype=np.int64)
            got = candidate_rows(logits[b], rows, targets)
            out.append((float(np.sum(got.target_logprob, dtype=np.float64)),
                        bool(np.all(got.top1 == targets))))
        return out

    def chat(self, messages: list[dict], max_tokens: int, *, thinking: bool = True
             ) -> Generation:
        import torch

        ids = chat_prompt_ids(self.tokenizer, messages, thinking)
        with torch.no_grad():
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=max_tokens,
                                      do_sample=False, attention_mask=torch.ones(1, len(ids),
                                                                                 dtype=torch.long))
        new = out[0, len(ids):].tolist()
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        ended = bool(new) and new[-1] in eos
        # special tokens dropped as a server's detokenizer drops them (the think tags of
        # Qwen3 and DeepSeek-R1 are ordinary added tokens: they stay)
        text = self.tokenizer.decode(new[:-1] if ended else new, skip_special_tokens=True)
        return Generation(text, None, "stop" if ended or len(new) < max_tokens else "length")

    def close(self) -> None:
        self._model = None


def _quantization(path: Path) -> str | None:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    quant = config.get("quantization_config") or config.get("compression_config")
    return (quant or {}).get("quant_method") if quant else None


# -- GGUF through llama.cpp's Python bindings -------------------------------------------


class _LlamaCppTokenizer:
    """Called like a Hugging Face tokenizer, backed by the GGUF's own vocabulary."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.bos_token_id = llm.token_bos() if llm.token_bos() >= 0 else None
        self.eos_token_id = llm.token_eos() if llm.token_eos() >= 0 else None
        meta = getattr(llm, "metadata", {}) or {}
        self.add_bos = str(meta.get("tokenizer.ggml.add_bos_token", "false")).lower() == "true"

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return {"input_ids": list(ids)}

    def decode(self, ids: list[int]) -> str:
        return self.llm.detokenize(ids).decode("utf-8", errors="replace")


class LlamaCppCandidate(Candidate, kind="gguf"):
    """A .gguf file run by llama.cpp (``pip install llama-cpp-python``), through
    ``llmctl.gguf.llamacpp.LlamaCppModel`` (``logits_all=True``: without it recent
    bindings leave ``Llama.scores`` unfilled, FACTS.md)."""

    priority = 20

    @classmethod
    def matches(cls, spec: str) -> bool:
        return spec.lower().endswith(".gguf") and Path(spec).expanduser().is_file()

    def __init__(self, spec: str, options: CandidateOptions) -> None:
        super().__init__(spec, options)
        from llmctl.gguf import llamacpp

        if not llamacpp.available():
            raise MissingDependencyError(
                "evaluating a GGUF with llama.cpp needs llama-cpp-python",
                f"{llamacpp.INSTALL} (builds llama.cpp, ~15 min on 2 cores), or "
                "--backend transformers to evaluate its dequantized weights with transformers")
        self.path = Path(spec).expanduser().resolve()
        self._model = None
        self._ensure(512)

    def _ensure(self, n_tokens: int) -> None:
        if self._model is not None and n_tokens <= self._model.n_ctx:
            return
        from llmctl.gguf.llamacpp import LlamaCppModel

        if self._model is not None:
            self._model.close()
        n_ctx = max(n_tokens, 512)
        self._model = LlamaCppModel(self.path, n_ctx=n_ctx, n_batch=n_ctx,
                                    threads=self.options.threads)
        self._tokenizer = _LlamaCppTokenizer(self._model.llm)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self._model.llm.n_vocab())

    def describe(self) -> dict[str, Any]:
        from llmctl.gguf import llamacpp

        return {"kind": self.kind, "reference": self.spec, "path": str(self.path),
                "sha256_quick": fingerprint_path(self.path),
                "llama_cpp_python": llamacpp.version()}

    def logits(self, input_ids: list[int]):
        import torch

        self._ensure(len(input_ids))
        return torch.from_numpy(self._model.logits(list(input_ids)))

    def close(self) -> None:
        if self._model is not None:
            self._model.close()
            self._model = None


# -- a running OpenAI-compatible server ------------------------------------------------

_TOKEN_ID = re.compile(r"^token_id:(\d+)$")


class OpenAIServerCandidate(Candidate, kind="openai"):
    """``openai:http://host:port[/v1]`` (or a bare http URL): prompt log-probs.

    Sends token ids as the prompt with ``echo=true, logprobs=k, max_tokens=1`` and reads
    back each prompt token's log-prob and the server's top-k. Servers that support it
    (vLLM) are asked for ``token_id:N`` strings; otherwise token strings are mapped
    back to ids through the tokenizer (ambiguous strings keep the first id).
    """

    priority = 10

    @classmethod
    def matches(cls, spec: str) -> bool:
        return spec.startswith(("openai:", "http://", "https://"))

    def __init__(self, spec: str, options: CandidateOptions) -> None:
        super().__init__(spec, options)
        import httpx

        url = spec.removeprefix("openai:").rstrip("/")
        self.base_url = url if url.endswith("/v1") else url + "/v1"
        self.client = httpx.Client(timeout=options.timeout_s)
        self.model_name = options.server_model or self._first_model()
        if options.tokenizer is None:
            raise ConfigError("a server candidate needs a tokenizer to turn text into token ids",
                              "pass --reference MODEL (its tokenizer is used) or --tokenizer DIR")
        self._tokenizer = options.tokenizer
        self._by_string: dict[str, int] | None = None
        self.unmapped_tokens = 0

    def _first_model(self) -> str:
        import httpx

        try:
            data = self.client.get(f"{self.base_url}/models").json()
            return data["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise OfflineError(f"cannot list models at {self.base_url}/models: {exc}",
                               "check the URL, or pass --server-model NAME") from None

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "reference": self.spec, "url": self.base_url,
                "model": self.model_name, "top_logprobs": self.options.server_top_logprobs,
                "unmapped_tokens": self.unmapped_tokens}

    def _token_id(self, text: str) -> int | None:
        match = _TOKEN_ID.match(text)
        if match:
            return int(match.group(1))
        if self._by_string is None:
            table: dict[str, int] = {}
            for i in range(len(self._tokenizer)):
                table.setdefault(self._tokenizer.decode([i]), i)
            self._by_string = table
        return self._by_string.get(text)

    def _prompt_logprobs(self, input_ids: list[int]) -> dict[str, Any]:
        payload = {"model": self.model_name, "prompt": list(input_ids), "max_tokens": 1,
                   "echo": True, "logprobs": self.options.server_top_logprobs,
                   "temperature": 0.0, "return_tokens_as_token_ids": True}
        response = self.client.post(f"{self.base_url}/completions", json=payload)
        if response.status_code != 200:
            raise ConfigError(f"the server refused a prompt-logprobs request: HTTP "
                              f"{response.status_code} {response.text[:200]}",
                              "the server must accept token-id prompts with echo and logprobs")
        logprobs = (response.json().get("choices") or [{}])[0].get("logprobs") or {}
        if not logprobs.get("token_logprobs") or len(logprobs["token_logprobs"]) < len(input_ids):
            raise ConfigError(f"{self.base_url} does not return log-probs for prompt tokens",
                              "use a server that supports echo=true with logprobs "
                              "(vLLM, llama-cpp-python), or evaluate the model directly")
        return logprobs

    def rows(self, input_ids: list[int], rows: np.ndarray, targets: np.ndarray,
             reference_ids: np.ndarray | None = None) -> CandidateRows:
        logprobs = self._prompt_logprobs(input_ids)
        # OpenAI entry e is about prompt token e given tokens < e: our row e - 1.
        tokens, token_lp, top = (logprobs["tokens"], logprobs["token_logprobs"],
                                 logprobs.get("top_logprobs") or [])
        n = len(rows)
        target_lp = np.empty(n, dtype=np.float64)
        top1 = np.full(n, -1, dtype=np.int64)
        at_ref = None if reference_ids is None else np.full(reference_ids.shape, np.nan)
        for i, row in enumerate(rows):
            e = int(row) + 1
            seen = self._token_id(tokens[e])
            if seen is not None and seen != input_ids[e] and not _TOKEN_ID.match(tokens[e]) \
                    and self._tokenizer.decode([input_ids[e]]) == tokens[e]:
                seen = input_ids[e]  # a string several ids decode to
            if seen is not None and seen != input_ids[e]:
                raise ConfigError(f"the server tokenized the prompt differently at position {e} "
                                  f"({tokens[e]!r} for id {input_ids[e]})",
                                  "the server's model must use the reference's tokenizer")
            target_lp[i] = token_lp[e]
            entry = top[e] if e < len(top) and top[e] else {}
            mapped = {}
            for text, value in entry.items():
                tid = self._token_id(text)
                if tid is None:
                    self.unmapped_tokens += 1
                else:
                    mapped.setdefault(tid, float(value))
            if mapped:
                top1[i] = max(mapped, key=mapped.__getitem__)
            if at_ref is not None:
                for j, tid in enumerate(reference_ids[i]):
                    if int(tid) in mapped:
                        at_ref[i, j] = mapped[int(tid)]
        return CandidateRows(target_lp, top1, at_ref, None)

    def chat(self, messages: list[dict], max_tokens: int, *, thinking: bool = True
             ) -> Generation:
        """A greedy chat completion; a reasoning parser's split (``reasoning`` or the older
        ``reasoning_content``) is kept apart from ``content``."""
        payload = {"model": self.model_name, "messages": messages, "max_tokens": max_tokens,
                   "temperature": 0.0}
        if not thinking:
            payload["chat_template_kwargs"] = {"enable_thinking": False}
        response = self.client.post(f"{self.base_url}/chat/completions", json=payload)
        if response.status_code != 200:
            raise ConfigError(f"the server refused a chat completion: HTTP "
                              f"{response.status_code} {response.text[:200]}",
                              "the server must serve /v1/chat/completions for generative tasks")
        choice = (response.json().get("choices") or [{}])[0]
        message = choice.get("message") or {}
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        return Generation(message.get("content") or "", reasoning,
                          choice.get("finish_reason") or "stop")

    def close(self) -> None:
        self.client.close()


BACKEND_KINDS: dict[str, Callable[[str], str | None]] = {
    # --backend X forces a kind for specs that more than one adapter could run.
    "transformers": lambda spec: "hf",
    "llama-cpp": lambda spec: "gguf",
    "serve": lambda spec: "serve",
    "auto": lambda spec: None,
}


def open_candidate(spec: str, options: CandidateOptions | None = None) -> Candidate:
    options = options or CandidateOptions()
    if options.backend not in BACKEND_KINDS:
        raise ConfigError(f"unknown backend {options.backend!r}",
                          f"use one of: {', '.join(BACKEND_KINDS)}")
    forced = BACKEND_KINDS[options.backend](spec)
    if forced is not None and not OpenAIServerCandidate.matches(spec):
        return REGISTRY[forced](spec, options)
    for cls in sorted(REGISTRY.values(), key=lambda c: c.priority):
        if cls.matches(spec):
            return cls(spec, options)
    raise ConfigError(f"no candidate adapter for {spec!r}",  # pragma: no cover (hf matches all)
                      f"known kinds: {', '.join(REGISTRY)}")


# the adapters of llmctl's own engines register themselves on import (their module imports
# this one's base class, hence the import at the end)
from llmctl.eval import engine_candidates  # noqa: F401
