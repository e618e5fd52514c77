"""Turn a GGUF file into a normal float32 Hugging Face checkpoint directory.

Four traps (shared/FACTS.md) are handled here, each covered by a test:
1. transformers refuses to save a model it loaded from GGUF: we never go through
   its GGUF model loader, so no quantizer state exists to refuse on.
2. The GGUF-derived tokenizer can name the wrong eos; we set eos/pad from the
   GGUF's own token ids (``<|im_end|>`` for SmolLM2).
3. transformers 5 writes only ``rope_parameters``; 4.x readers need ``rope_theta``.
4. transformers 5 writes ``tokenizer_class: TokenizersBackend``, unknown to 4.x;
   we write ``PreTrainedTokenizerFast``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from llmctl.models.gguf_reader import GGUFCheckpoint, open_checkpoint
from llmctl.models.manifest import write_manifest
from llmctl.utils.atomic import atomic_dir

Progress = Callable[[int, int], None]


def _save_tokenizer(ckpt: GGUFCheckpoint, out: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    where, name = str(ckpt.path.parent), ckpt.path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    except (ValueError, TypeError):
        # AutoTokenizer reads the whole config through transformers' GGUF loader, which
        # knows fewer architectures (olmo2, granite) than its tokenizer converter does
        # and fails on some keys it does not know (gpt-oss's per-layer SWA array: TypeError)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(where, gguf_file=name)
    vocab = {i: t for t, i in tokenizer.get_vocab().items()}
    eos_id = ckpt.config.get("eos_token_id")
    if eos_id is not None and eos_id in vocab:
        tokenizer.eos_token = vocab[eos_id]
    pad_id = ckpt.config.get("pad_token_id", eos_id)
    if pad_id is not None and pad_id in vocab:
        tokenizer.pad_token = vocab[pad_id]
    bos_id = ckpt.config.get("bos_token_id")
    if bos_id is not None and bos_id in vocab:
        tokenizer.bos_token = vocab[bos_id]
    template = ckpt.reader.fields.get("tokenizer.chat_template")
    if template is not None:
        tokenizer.chat_template = template.contents()
    tokenizer.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))


def import_gguf(path: Path, dest: Path, progress: Progress | None = None) -> Path:
    """Convert ``path`` into ``dest`` atomically; returns ``dest``."""
    import torch
    from safetensors.torch import save_file

    ckpt = open_checkpoint(path)
    with atomic_dir(dest, overwrite=True) as tmp:
        tensors: dict[str, torch.Tensor] = {}
        total = ckpt.tensor_count
        for done, (name, array) in enumerate(ckpt.tensors(), start=1):
            tensors[name] = torch.from_numpy(array)
            if progress:
                progress(done, total)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        (tmp / "config.json").write_text(json.dumps(ckpt.config, indent=2))
        generation = {k: ckpt.config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                      if k in ckpt.config}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        _save_tokenizer(ckpt, tmp)
        write_manifest(tmp, {"kind": "gguf", "path": str(Path(path).resolve())})
    return dest
