"""Hugging Face tokenizer -> GGUF tokenizer metadata (``tokenizer.ggml.*``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from llmctl.errors import UnsupportedArchitectureError


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
    chat_template: str | None = None


def _merge_strings(merges: list) -> list[str]:
    # tokenizers >= 0.20 stores merges as pairs; GGUF wants "left right" strings.
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def read_hf_vocab(directory: Path, config: dict, pre: str = "default") -> GGUFVocab:
    import gguf

    tok_json = json.loads((directory / "tokenizer.json").read_text())
    tok_config_path = directory / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text()) if tok_config_path.is_file() else {}
    model = tok_json["model"]
    if model.get("type") != "BPE":
        raise UnsupportedArchitectureError(
            f"tokenizer model {model.get('type')!r} cannot be exported to GGUF yet",
            "llmctl exports byte-level BPE tokenizers (Llama 3, Qwen, SmolLM2)",
        )
    vocab: dict[str, int] = dict(model["vocab"])
    special = set()
    for added in tok_json.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special.add(added["id"])
    size = max(config.get("vocab_size", 0), max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [int(gguf.TokenType.UNUSED)] * size
    for text, idx in vocab.items():
        tokens[idx] = text
        types[idx] = int(gguf.TokenType.CONTROL if idx in special else gguf.TokenType.NORMAL)
    special_ids = {k: config[f"{k}_token_id"] for k in ("bos", "eos", "pad")
                   if isinstance(config.get(f"{k}_token_id"), int)}
    if "eos" not in special_ids and tok_config.get("eos_token") in vocab:
        special_ids["eos"] = vocab[tok_config["eos_token"]]
    template = tok_config.get("chat_template")
    template_file = directory / "chat_template.jinja"
    if template is None and template_file.is_file():
        template = template_file.read_text()
    return GGUFVocab(
        model="gpt2",
        pre=pre,
        tokens=tokens,
        token_types=types,
        merges=_merge_strings(model.get("merges", [])),
        special_ids=special_ids,
        add_bos=bool(tok_config.get("add_bos_token", False)),
        add_eos=bool(tok_config.get("add_eos_token", False)),
        chat_template=template,
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
              "pad": writer.add_pad_token_id}
    for kind, idx in vocab.special_ids.items():
        adders[kind](idx)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)
