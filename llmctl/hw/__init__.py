"""Measuring this machine (``llmctl hw probe``): the timing code that runs llmctl's own
kernels, above :mod:`llmctl.serve`; the records, cache and peaks it produces are pure
data in :mod:`llmctl.perf.probe_record`."""
