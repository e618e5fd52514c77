"""llmctl: quantize, build, serve, benchmark and evaluate LLMs from one toolkit."""

__version__ = "0.1.0"
