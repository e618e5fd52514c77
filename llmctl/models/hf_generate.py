"""Reference generation through transformers ``generate`` (smoke use and tests)."""

from __future__ import annotations


def hf_generate(model, tokenizer, prompt_ids: list[int], *, max_tokens: int,
                temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None
                ) -> list[int]:
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    input_ids = torch.tensor([prompt_ids])
    sampling = temperature > 0
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_tokens,
            do_sample=sampling,
            temperature=temperature if sampling else None,
            top_p=top_p if sampling else None,
            top_k=None,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
            else tokenizer.eos_token_id,
        )
    return out[0, len(prompt_ids):].tolist()
