"""From ``llmctl serve`` settings to a running server: checks, assembly, uvicorn."""
