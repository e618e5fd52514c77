"""Which peaks a run is measured against: a named device, this machine, or the user's.

``hardware`` is a name in :mod:`llmctl.perf.devices`' datasheet table, ``"this"`` (the
cached ``llmctl hw probe`` of this CPU) or None (automatic: the GPU this process sees if
the table knows it, else the cached CPU probe). ``--peak-flops``/``--peak-bandwidth``
replace either value, and alone make the peaks when nothing else is known. Nothing is
guessed: unknown hardware gives None, and the report says to probe or override.
"""

from __future__ import annotations

from llmctl.perf.peaks import Peaks


def resolve_peaks(hardware: str | None = None, *, peak_flops: float | None = None,
                  dtype: str = "bf16", peak_bandwidth: float | None = None) -> Peaks | None:
    """The peaks for ``hardware`` with the overrides applied; None when unknown."""
    from llmctl.perf import devices
    from llmctl.perf.probe_record import cached_peaks

    if hardware not in (None, "this"):
        base = devices.device_peaks(hardware)  # an unknown name raises, listing the known
    elif hardware == "this":
        base = cached_peaks()
    else:
        base = devices.detect_gpu_peaks() or cached_peaks()
    if base is None:
        if peak_flops is None and peak_bandwidth is None:
            return None
        return Peaks({dtype: peak_flops} if peak_flops is not None else {}, peak_bandwidth,
                     "override (--peak-flops/--peak-bandwidth)")
    return base.with_overrides(flops=peak_flops, dtype=dtype, bandwidth=peak_bandwidth)
