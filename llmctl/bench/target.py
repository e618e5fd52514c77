"""What is being measured: the model (its tokenizer and checkpoint hash) and the server.

``--model`` may be something llmctl resolves (a checkpoint directory, a .gguf,
``smollm2-135m``) or only the name a remote server serves; then ``--tokenizer`` gives
the tokenizer used to count prompt lengths.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

from llmctl.errors import LlmctlError, UsageError

HASH_METHOD = "sha256 over (file name, size, sha256 of the first and last MiB) per file"


@dataclass
class ModelInfo:
    reference: str
    path: Path | None
    source: str | None
    checkpoint_hash: str | None
    tokenizer_id: str | None
    tokenizer: object | None

    def to_dict(self) -> dict:
        return {"reference": self.reference, "path": str(self.path) if self.path else None,
                "source": self.source, "checkpoint_hash": self.checkpoint_hash,
                "checkpoint_hash_method": HASH_METHOD if self.checkpoint_hash else None,
                "tokenizer": self.tokenizer_id}


def checkpoint_hash(directory: Path) -> str:
    """A content fingerprint of a checkpoint directory, cheap even for multi-GB files."""
    from llmctl.models.manifest import MANIFEST, quick_hash

    digest = hashlib.sha256()
    for path in sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST):
        digest.update(f"{path.name}\0{path.stat().st_size}\0{quick_hash(path)}\n".encode())
    return digest.hexdigest()


@functools.lru_cache(maxsize=4)
def _load_tokenizer(directory: Path):
    """Loading a tokenizer costs seconds (transformers import); sweeps and tests reuse it."""
    from llmctl.models.loading import load_tokenizer

    return load_tokenizer(directory)


def _tokenizer_dir(ref: str) -> Path:
    path = Path(ref).expanduser()
    if path.is_dir():
        return path  # a tokenizer-only directory is fine: no weights needed
    from llmctl.models.resolve import resolve_model

    return resolve_model(ref).path


def model_info(model: str | None, tokenizer: str | None,
               need_tokenizer: bool = True) -> ModelInfo:
    path = source = digest = None
    if model:
        from llmctl.models.resolve import resolve_model

        try:
            resolved = resolve_model(model)
            path, source = resolved.path, resolved.source
            digest = checkpoint_hash(path)
        except LlmctlError as exc:
            if not tokenizer and need_tokenizer:
                raise UsageError(f"cannot load {model!r} to count tokens: {exc.message}",
                                 "pass --tokenizer DIR when --model is only the name a "
                                 "remote server serves") from None
    tok = tok_id = None
    if tokenizer or path is not None:
        tok_dir = _tokenizer_dir(tokenizer) if tokenizer else path
        tok, tok_id = _load_tokenizer(Path(tok_dir).resolve()), str(tokenizer or model)
    elif need_tokenizer:
        raise UsageError("no tokenizer to count prompt tokens with",
                         "pass --model (a checkpoint llmctl can load) or --tokenizer DIR")
    return ModelInfo(model or "", path, source, digest, tok_id, tok)
