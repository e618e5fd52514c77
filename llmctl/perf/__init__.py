"""Performance models: FLOPs and bytes per token from a model config, the peak rates of
the hardware, utilization (MFU/MBU), bottleneck verdicts, cost, and ``llmctl plan``.

Pure arithmetic apart from :mod:`llmctl.perf.probe` (which measures this machine); no
torch import at module level anywhere else in the package."""
