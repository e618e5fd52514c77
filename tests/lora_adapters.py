"""Random PEFT LoRA adapters for tests and benchmarks, made with PEFT itself.

PEFT initialises ``lora_B`` to zero, so a fresh adapter changes nothing and a test
comparing against it could not fail: every ``lora_A`` and ``lora_B`` is redrawn here.
"""

from __future__ import annotations

from pathlib import Path

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(model_dir: Path, out: Path, *, rank: int, alpha: float, seed: int,
                  targets: list[str] | None = None, std: float = 0.1,
                  use_rslora: bool = False, **config) -> Path:
    """A random LoRA on the checkpoint at ``model_dir``, saved with ``save_pretrained``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_PROJECTIONS,
                      lora_dropout=0.0, use_rslora=use_rslora, task_type="CAUSAL_LM", **config)
    peft_model = get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(str(out))
    return out


def peft_model(model_dir: Path, adapter_dir: Path | None):
    """The float32 reference: transformers + PEFT, unmerged (None: the base model)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is None:
        return model.eval()
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter_dir)).eval()
