"""The engine front: requests in, outputs out (offline, in-process and async entry points)."""
