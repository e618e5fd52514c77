"""Choosing tokens: sampling parameters, the sampler, constraints, speculation."""
