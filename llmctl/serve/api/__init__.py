"""The OpenAI-compatible HTTP front end of the built-in engine (``llmctl serve``)."""
