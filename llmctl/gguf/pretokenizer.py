"""Which BPE pre-tokenizer a Hugging Face tokenizer uses, named as llama.cpp knows it.

llama.cpp does not read ``tokenizer.json``'s pre-tokenizer: it implements each known
one in C++ and picks it by the GGUF key ``tokenizer.ggml.pre``. A wrong name splits
text differently and silently degrades generation.

llama.cpp's converter (``convert_hf_to_gguf.py``, ``get_vocab_base_pre``) names the
pre-tokenizer by the SHA-256 of ``str(tokenizer.encode(CHECK_TEXT))``; the same text
and hashes are used here (hashes are facts about the public tokenizers, one row per
tokenizer family). When the hash is unknown (a new or retrained vocabulary, like the
test suite's tiny tokenizer), the structure of ``tokenizer.json``'s pre-tokenizer is
matched against the regexes llama.cpp implements; only then do we fall back to
``default`` with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# The check string of llama.cpp's convert_hf_to_gguf_update.py: whitespace runs, emoji
# sequences, digit runs, Khmer, CJK, Cyrillic, quote runs and English contractions.
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis "
    "concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 "
    "កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български "
    "''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? "
    "'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)

# sha256(str(token ids of CHECK_TEXT)) -> (llama.cpp pre-tokenizer name, reference model).
# The families llmctl converts (Llama, Mistral, Qwen, SmolLM) plus a few common
# relatives so a user's fine-tune of them is named right.
KNOWN_HASHES: dict[str, tuple[str, str]] = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5":
        ("llama-bpe", "meta-llama/Meta-Llama-3-8B"),
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d":
        ("smaug-bpe", "abacusai/Smaug-Llama-3-70B-Instruct"),
    "d353350c764d8c3b39c763113960e4fb4919bea5fbf208a0e3b22e8469dc7406":
        ("llama4", "meta-llama/Llama-4-Scout-17B-16E-Instruct"),
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249":
        ("smollm", "HuggingFaceTB/SmolLM-135M"),
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea":
        ("qwen2", "Qwen/Qwen1.5-7B"),
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c":
        ("qwen2", "Qwen/Qwen3-Embedding-0.6B"),
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5":
        ("deepseek-r1-qwen", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"),
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e":
        ("tekken", "mistralai/Mistral-Nemo-Base-2407"),
    "0e9433cbbb161f89e264eb32e8e64bfe69e834973ffca5d41d3948a604a3e2a3":
        ("pixtral", "mistral-community/pixtral-12b"),
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454":
        ("gpt-2", "openai-community/gpt2"),
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754":
        ("deepseek-llm", "deepseek-ai/deepseek-llm-7b-base"),
    "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821":
        ("deepseek-coder", "deepseek-ai/deepseek-coder-6.7b-base"),
    "877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5":
        ("deepseek-v3", "deepseek-ai/DeepSeek-V3"),
    "9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e":
        ("falcon3", "tiiuae/Falcon3-7B-Base"),
    "35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34":
        ("starcoder", "bigcode/starcoder2-3b"),
    "b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166":
        ("olmo", "allenai/OLMo-1.7-7B-hf"),
    "32d85c31273f8019248f2559fed492d929ea28b17e51d81d3bb36fff23ca72b3":
        ("stablelm2", "stabilityai/stablelm-2-zephyr-1_6b"),
}

# The split regexes of tokenizer.json as published, for the structural match.
_GPT2_BYTELEVEL = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
           r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
          r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Normalised pre-tokenizer structure -> llama.cpp name. Each step is (type, detail):
# ByteLevel's detail is whether it applies the GPT-2 regex itself, Split's its regex,
# Digits' whether digits are split one by one.
STRUCTURES: dict[tuple[tuple[str, Any], ...], str] = {
    (("ByteLevel", True),): "gpt-2",
    (("Digits", True), ("ByteLevel", True)): "smollm",
    (("Split", _LLAMA3), ("ByteLevel", False)): "llama-bpe",
    (("Split", _QWEN2), ("ByteLevel", False)): "qwen2",
}


@dataclass(frozen=True)
class PreTokenizerMatch:
    name: str
    method: str  # "hash" | "structure" | "fallback"
    detail: str  # reference model, structure, or why nothing matched
    chkhsh: str | None = None


def check_hash(tokenizer) -> str:
    """The converter's fingerprint: sha256 of the printed list of ids of CHECK_TEXT."""
    ids = tokenizer.encode(CHECK_TEXT)
    return hashlib.sha256(str(ids).encode()).hexdigest()


def _step(node: dict[str, Any]) -> tuple[str, Any]:
    kind = node.get("type")
    if kind == "ByteLevel":
        return kind, bool(node.get("use_regex", True))
    if kind == "Split":
        pattern = node.get("pattern", {})
        return kind, pattern.get("Regex", pattern.get("String"))
    if kind == "Digits":
        return kind, bool(node.get("individual_digits", False))
    return kind, None


def structure_of(tokenizer_json: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    pre = tokenizer_json.get("pre_tokenizer") or {}
    nodes = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    return tuple(_step(n) for n in nodes if n)


def detect_pre_tokenizer(directory: Path, tokenizer=None) -> PreTokenizerMatch:
    """Name the pre-tokenizer of the BPE tokenizer in ``directory`` for llama.cpp."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    chkhsh = check_hash(tokenizer)
    if chkhsh in KNOWN_HASHES:
        name, ref = KNOWN_HASHES[chkhsh]
        return PreTokenizerMatch(name, "hash", ref, chkhsh)
    tok_json_path = Path(directory) / "tokenizer.json"
    structure: tuple = ()
    if tok_json_path.is_file():
        structure = structure_of(json.loads(tok_json_path.read_text(encoding="utf-8")))
        if structure in STRUCTURES:
            return PreTokenizerMatch(STRUCTURES[structure], "structure",
                                     " + ".join(k for k, _ in structure), chkhsh)
    detail = (f"unknown tokenizer (check hash {chkhsh[:12]}, pre-tokenizer "
              f"{[k for k, _ in structure] or 'none'})")
    log.warning("%s: llama.cpp will use its 'default' pre-tokenizer; tokenization may differ "
                "from Hugging Face's on digits, whitespace and punctuation", detail)
    return PreTokenizerMatch("default", "fallback", detail, chkhsh)
