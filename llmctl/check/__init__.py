"""``llmctl check``: a pipeline file in, a CI verdict out (quantize, serve, bench, eval, gates)."""
