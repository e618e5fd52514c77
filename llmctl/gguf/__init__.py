"""GGUF, llama.cpp's file format: reading (import) and writing (export)."""
