"""The layers a forward is built of: attention, RoPE, plain and low-bit linears, fused decode layers, KV quantization."""
