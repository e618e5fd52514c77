"""Performance models: FLOPs and bytes per token from a model config, the peak rates of
the hardware, utilization (MFU/MBU), bottleneck verdicts, cost, and ``llmctl plan``.

Pure arithmetic and data, no torch import at module level: the probe that measures this
machine with llmctl's own kernels is :mod:`llmctl.hw.probe`, above :mod:`llmctl.serve`
(whose engine meters its steps with this package)."""
