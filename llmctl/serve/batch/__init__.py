"""``llmctl batch``: OpenAI Batch API files run on the engine, without HTTP."""
