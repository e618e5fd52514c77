"""Turn user text into prompt token ids (plain or through the chat template)."""

from __future__ import annotations

from llmctl.errors import UsageError


def encode_prompt(tokenizer, prompt: str, *, chat: bool, system: str | None = None) -> list[int]:
    if not chat:
        return tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("this model has no chat template", "drop --chat to send plain text")
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding here, 4.x a plain list.
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
