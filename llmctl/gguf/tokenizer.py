"""Hugging Face tokenizer -> GGUF tokenizer metadata (``tokenizer.ggml.*``).

Two vocabulary kinds, told apart by ``tokenizer.json``:

- byte-level BPE (GPT-2 style: Llama 3, Qwen, SmolLM2) -> GGUF model ``gpt2`` with
  merges and a named pre-tokenizer (:mod:`llmctl.gguf.pretokenizer`);
- SentencePiece BPE with byte fallback (Llama 2, Mistral v0.1-v0.3), either from
  ``tokenizer.model`` (needs the ``sentencepiece`` package) or from its
  ``tokenizer.json`` conversion -> GGUF model ``llama`` with scores and token types
  (``<0xNN>`` byte tokens are BYTE, the unknown token UNKNOWN).

Token types follow llama.cpp's converter: added tokens that are special (or look like
``<|...|>``) are CONTROL, other added tokens USER_DEFINED, ids nobody uses UNUSED.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmctl.errors import UnsupportedArchitectureError
from llmctl.gguf.pretokenizer import PreTokenizerMatch, detect_pre_tokenizer

# gguf.TokenType values (llama.cpp's llama_token_type), kept here so this module
# imports without gguf.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclass
class GGUFVocab:
    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str] = field(default_factory=list)
    scores: list[float] | None = None
    special_ids: dict[str, int] = field(default_factory=dict)
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool | None = None
    chat_template: str | None = None
    pre_match: PreTokenizerMatch | None = None

    def describe(self) -> dict[str, Any]:
        """What the summary and ``--dry-run`` print about the tokenizer."""
        out: dict[str, Any] = {"model": self.model, "pre": self.pre, "size": len(self.tokens),
                               "merges": len(self.merges), "special_ids": self.special_ids,
                               "add_bos": self.add_bos, "add_eos": self.add_eos,
                               "chat_template": self.chat_template is not None}
        if self.pre_match is not None:
            out["pre_detection"] = {"method": self.pre_match.method, "detail": self.pre_match.detail}
        return out


def _merge_strings(merges: list) -> list[str]:
    # tokenizers >= 0.20 stores merges as pairs; GGUF wants "left right" strings.
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def _looks_special(text: str) -> bool:
    return (text.startswith("<|") and text.endswith("|>")) or text in ("<pad>", "<mask>")


def _is_sentencepiece(tok_json: dict[str, Any]) -> bool:
    model = tok_json.get("model", {})
    decoder = json.dumps(tok_json.get("decoder") or {})
    return (model.get("type") == "BPE" and bool(model.get("byte_fallback"))
            and "ByteLevel" not in decoder)


def _special_ids(config: dict, tokenizer) -> dict[str, int]:
    ids: dict[str, int] = {}
    for kind in ("bos", "eos", "pad", "unk"):
        value = config.get(f"{kind}_token_id")
        if isinstance(value, list):  # some configs list several eos ids; llama.cpp takes one
            value = value[0] if value else None
        if not isinstance(value, int):
            value = getattr(tokenizer, f"{kind}_token_id", None)
        if isinstance(value, int):
            ids[kind] = value
    return ids


def _adds(tokenizer, special: dict[str, int]) -> tuple[bool, bool]:
    """Whether encoding plain text adds bos / eos: ask the tokenizer, do not guess."""
    ids = tokenizer.encode("a", add_special_tokens=True)
    bare = tokenizer.encode("a", add_special_tokens=False)
    add_bos = "bos" in special and len(ids) > len(bare) and ids[0] == special["bos"]
    add_eos = "eos" in special and len(ids) > len(bare) and ids[-1] == special["eos"]
    return add_bos, add_eos


def _chat_template(directory: Path, tok_config: dict) -> str | None:
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    template_file = directory / "chat_template.jinja"
    if template is None and template_file.is_file():
        template = template_file.read_text(encoding="utf-8")
    return template


def _table(size: int) -> tuple[list[str], list[int]]:
    return [f"[PAD{i}]" for i in range(size)], [UNUSED] * size


def _bpe_vocab(tok_json: dict, size: int) -> tuple[list[str], list[int], list[str]]:
    model = tok_json["model"]
    tokens, types = _table(size)
    for text, idx in model["vocab"].items():
        if idx < size:
            tokens[idx], types[idx] = text, NORMAL
    return tokens, types, _merge_strings(model.get("merges", []))


def _spm_from_json(tok_json: dict, size: int) -> tuple[list[str], list[int], list[float]]:
    """A tokenizers-format SentencePiece BPE -> tokens, types, scores.

    llama.cpp's SPM tokenizer merges the adjacent pair whose joined piece has the
    highest score; HF's BPE applies merges by rank. Scoring each piece by minus the
    rank of the first merge that builds it gives llama.cpp the same order.
    """
    model = tok_json["model"]
    tokens, types = _table(size)
    scores = [-1e4] * size
    vocab: dict[str, int] = model["vocab"]
    rank: dict[str, int] = {}
    for i, merge in enumerate(_merge_strings(model.get("merges", []))):
        rank.setdefault(merge.replace(" ", ""), i)
    unk = model.get("unk_token")
    for text, idx in vocab.items():
        if idx >= size:
            continue
        tokens[idx] = text
        scores[idx] = -float(rank[text]) if text in rank else 0.0
        if text == unk:
            types[idx] = UNKNOWN
        elif _BYTE_TOKEN.fullmatch(text):
            types[idx] = BYTE
        else:
            types[idx] = NORMAL
    return tokens, types, scores


def _spm_from_model(path: Path, size: int) -> tuple[list[str], list[int], list[float]]:
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(path))
    tokens, types = _table(size)
    scores = [-1e4] * size
    for idx in range(min(size, sp.vocab_size())):
        tokens[idx], scores[idx] = sp.IdToPiece(idx), sp.GetScore(idx)
        types[idx] = (UNKNOWN if sp.IsUnknown(idx) else CONTROL if sp.IsControl(idx)
                      else UNUSED if sp.IsUnused(idx) else BYTE if sp.IsByte(idx) else NORMAL)
    return tokens, types, scores


def _has_sentencepiece() -> bool:
    import importlib.util

    return importlib.util.find_spec("sentencepiece") is not None


def read_hf_vocab(directory: Path, config: dict, pre: str | None = None,
                  tokenizer=None) -> GGUFVocab:
    """Everything llama.cpp needs to tokenize like the checkpoint in ``directory``.

    ``pre`` forces the pre-tokenizer name; by default it is detected.
    """
    directory = Path(directory)
    tok_json_path = directory / "tokenizer.json"
    if not tok_json_path.is_file():
        raise UnsupportedArchitectureError(
            f"{directory} has no tokenizer.json",
            "llmctl exports fast (tokenizers) vocabularies; save the tokenizer with "
            "transformers to create tokenizer.json",
        )
    tok_json = json.loads(tok_json_path.read_text(encoding="utf-8"))
    tok_config_path = directory / "tokenizer_config.json"
    tok_config = (json.loads(tok_config_path.read_text(encoding="utf-8"))
                  if tok_config_path.is_file() else {})
    if tok_json.get("model", {}).get("type") != "BPE":
        raise UnsupportedArchitectureError(
            f"tokenizer model {tok_json.get('model', {}).get('type')!r} cannot be exported "
            "to GGUF yet",
            "llmctl exports BPE tokenizers: byte-level (Llama 3, Qwen, SmolLM2) and "
            "SentencePiece with byte fallback (Llama 2, Mistral)",
        )
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    added = {a["id"]: a for a in tok_json.get("added_tokens", [])}
    size = max([config.get("vocab_size") or 0, *[i + 1 for i in added],
                max(tok_json["model"]["vocab"].values()) + 1])

    match: PreTokenizerMatch | None = None
    merges: list[str] = []
    scores: list[float] | None = None
    add_space_prefix: bool | None = None
    if _is_sentencepiece(tok_json):
        model_name, pre_name = "llama", "default"
        spm_file = directory / "tokenizer.model"
        if spm_file.is_file() and _has_sentencepiece():
            tokens, types, scores = _spm_from_model(spm_file, size)
        else:
            tokens, types, scores = _spm_from_json(tok_json, size)
        # Llama 2 style normalizers prepend "▁"; llama.cpp needs to be told to do the same.
        add_space_prefix = "Prepend" in json.dumps(tok_json.get("normalizer") or {}) or \
            "prepend_scheme" in json.dumps(tok_json.get("pre_tokenizer") or {})
    else:
        model_name = "gpt2"
        tokens, types, merges = _bpe_vocab(tok_json, size)
        if pre is None:
            match = detect_pre_tokenizer(directory, tokenizer)
            pre_name = match.name
        else:
            pre_name = pre
    for idx, entry in added.items():
        text = entry["content"]
        tokens[idx] = text
        special = entry.get("special") or _looks_special(text)
        if types[idx] in (BYTE, UNKNOWN):  # <unk> and <0xNN> keep their SentencePiece role
            continue
        types[idx] = CONTROL if special else USER_DEFINED
        if scores is not None:
            scores[idx] = -1000.0
    special_ids = _special_ids(config, tokenizer)
    add_bos, add_eos = _adds(tokenizer, special_ids)
    return GGUFVocab(
        model=model_name,
        pre=pre_name,
        tokens=tokens,
        token_types=types,
        merges=merges,
        scores=scores,
        special_ids=special_ids,
        add_bos=add_bos,
        add_eos=add_eos,
        add_space_prefix=add_space_prefix,
        chat_template=_chat_template(directory, tok_config),
        pre_match=match,
    )


def write_vocab(writer, vocab: GGUFVocab) -> None:
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    adders = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id,
              "pad": writer.add_pad_token_id, "unk": writer.add_unk_token_id}
    for kind, idx in vocab.special_ids.items():
        adders[kind](idx)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)
