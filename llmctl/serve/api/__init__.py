"""The OpenAI-compatible HTTP front end of the built-in engine (``llmctl serve``): HTTP
only (routers, the request handler, keys and tenants, limits, tracing, metrics); the
OpenAI work itself is :mod:`llmctl.serve.openai`'s, shared with ``llmctl batch``."""
