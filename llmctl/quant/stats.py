"""Calibration statistics of one tap (the input shared by the linears it feeds).

A quantization method says which statistics it wants (:class:`Needs`); the layer
streamer feeds every chunk of the tap's input to a :class:`TapStats` built for those
needs. The range (``lo``/``hi``, for static activation scales) and a probe of the first
tokens (for the error report) are always kept: they are cheap and every scheme with
calibration data reports an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl.quant.hessian import HessianAccumulator

PROBE_TOKENS = 512


@dataclass(frozen=True)
class Needs:
    """Which per-tap statistics a method reads from the calibration inputs."""

    hessian: bool = False  # X^T X (GPTQ's H, AWQ's output-error metric)
    absmax: bool = False  # per-channel max |x| (SmoothQuant)
    absmean: bool = False  # per-channel mean |x| (AWQ's scale search)


NOTHING = Needs()


class TapStats:
    """What the methods of one tap need from its inputs, accumulated over chunks."""

    def __init__(self, dim: int, needs: Needs, device) -> None:
        self.h = HessianAccumulator(dim, device) if needs.hessian else None
        self.absmax = torch.zeros(dim, device=device) if needs.absmax else None
        self.abssum = torch.zeros(dim, device=device) if needs.absmean else None
        self.lo = torch.tensor(0.0, device=device)
        self.hi = torch.tensor(0.0, device=device)
        self.count = 0
        self.probe: list[torch.Tensor] = []
        self.probe_rows = 0
        self.preset_moment: torch.Tensor | None = None  # supplied by an earlier pass

    def add(self, x: torch.Tensor) -> None:
        flat = x.reshape(-1, x.shape[-1])
        if self.h is not None:
            self.h.add(flat)
        if self.absmax is not None:
            torch.maximum(self.absmax, flat.abs().amax(dim=0).float(), out=self.absmax)
        if self.abssum is not None:
            self.abssum += flat.abs().float().sum(dim=0)
        self.lo = torch.minimum(self.lo, flat.min().float())
        self.hi = torch.maximum(self.hi, flat.max().float())
        self.count += flat.shape[0]
        if self.probe_rows < PROBE_TOKENS:
            take = flat[: PROBE_TOKENS - self.probe_rows]
            self.probe.append(take.clone())
            self.probe_rows += take.shape[0]

    @property
    def hessian(self) -> torch.Tensor:
        return self.h.hessian()

    @property
    def second_moment(self) -> torch.Tensor:
        """``X^T X / n``: the Hessian without GPTQ's factor 2."""
        if self.preset_moment is not None:
            return self.preset_moment
        return self.h.hessian() / 2

    @property
    def absmean(self) -> torch.Tensor:
        return self.abssum / max(self.count, 1)


class ExpertStats:
    """The statistics of a mixture-of-experts tap, one :class:`TapStats` per expert (and
    the shared expert), with the tokens the router sent each (``routed``) beside the
    tokens its statistics saw (``TapStats.count``). With ``all_experts`` the gate/up
    inputs of every expert are the same tokens, so one accumulator serves them all."""

    def __init__(self, dims: dict[str, int], needs: Needs, device, *,
                 shared_input: bool = False) -> None:
        common = TapStats(next(iter(dims.values())), needs, device) if shared_input else None
        self.groups = {g: (common if common is not None and g.startswith("expert.")
                           else TapStats(d, needs, device)) for g, d in dims.items()}
        self.counts = dict.fromkeys(dims, 0)

    def routed(self, group: str, n: int) -> None:
        self.counts[group] += n

    def add(self, group: str, x: torch.Tensor) -> None:
        self.groups[group].add(x)

    def add_every_expert(self, x: torch.Tensor) -> None:
        """One input every expert sees (``shared_input``): added once."""
        first = next(g for g in self.groups if g.startswith("expert."))
        self.groups[first].add(x)

    def tap_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(lo, hi) over every group: the range an expert without tokens falls back to
        for a static activation scale."""
        lo = torch.stack([s.lo for s in self.groups.values()]).min()
        hi = torch.stack([s.hi for s in self.groups.values()]).max()
        return lo, hi
