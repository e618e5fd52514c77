"""Handing a model to another serving engine (vLLM, TensorRT-LLM)."""
