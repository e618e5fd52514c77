"""llmctl: quantize, build, serve, benchmark and evaluate LLMs from one toolkit."""

__version__ = "0.1.0"

# The engine's offline API, imported on first use so `llmctl --help` stays torch-free.
_LAZY = {"LLM": "llmctl.serve.engine.llm", "SamplingParams": "llmctl.serve.core.sampling_params"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llmctl' has no attribute {name!r}")
