"""Tenants: API keys, their limits, and the request path's calls for them."""
