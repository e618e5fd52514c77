"""OpenAI's completions and chat without HTTP: bodies in, engine requests out, engine
outputs back to OpenAI bodies. The HTTP server (:mod:`llmctl.serve.api`) and ``llmctl
batch`` (:mod:`llmctl.serve.batch`) compose the same pieces
(:class:`~llmctl.serve.openai.frontend.Frontend`), so a batch line gets what the HTTP
API would answer; nothing here imports FastAPI or starlette."""
