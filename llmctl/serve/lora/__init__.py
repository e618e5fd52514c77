"""LoRA adapters: loading them, and one step's LoRA work."""
