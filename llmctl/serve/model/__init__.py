"""The model on the paged KV cache: its forward, weights, KV cache sizing, the runner."""
