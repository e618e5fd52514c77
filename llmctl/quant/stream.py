"""One layer's calibration activations, run chunk by chunk up to each tap.

The layer is walked stage by stage (``block``): a tap's input is produced for every
calibration chunk and handed to a statistics sink, the linears in between applied
through a callback so the caller decides which weights (float, smoothed, quantized)
and which activation quantizers they use. Quantization methods never see this: the
streamer collects what they ask for and passes them the statistics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from llmctl.quant import block
from llmctl.quant.method import BlockLoss
from llmctl.quant.moe_block import moe_forward, route_inputs
from llmctl.quant.stats import ExpertStats, TapStats


class LayerStream:
    """Runs the calibration activations ``X`` (samples, seq, hidden) through a layer.

    ``tables``: the RoPE cos/sin of the model (``"global"``) and of its sliding layers
    where they rotate differently (``"local"``, Gemma 3); :meth:`at` moves the stream to
    decoder layer ``i`` (its window and table)."""

    def __init__(self, shape: block.BlockShape, tables: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 chunk: int, dtype: torch.dtype, device) -> None:
        self.model_shape = self.shape = shape
        self.intermediate = shape.intermediate
        self.tables = tables
        self.cos, self.sin = tables["global"]
        self.chunk, self.cdt, self.device = chunk, dtype, device
        self._buffer: torch.Tensor | None = None
        # a mixture of experts' statistics: every token through every expert (the
        # output keeps the real routing); see moe_block
        self.all_experts = True

    @classmethod
    def for_model(cls, arch, seq_len: int, chunk: int, dtype: torch.dtype, device) -> LayerStream:
        """The stream of a model (:class:`llmctl.models.spec.ModelArch`) over calibration
        sequences of ``seq_len`` tokens, ``chunk`` sequences at a time."""
        tables = {"global": block.rotary_tables(arch, seq_len, dtype, device)}
        if arch.local_rope is not None:  # Gemma 3's sliding layers
            tables["local"] = block.rotary_tables(arch, seq_len, dtype, device, local=True)
        return cls(block.BlockShape.from_arch(arch), tables, chunk, dtype, device)

    def at(self, layer: int) -> LayerStream:
        self.shape = self.model_shape.at(layer)
        self.cos, self.sin = self.tables["local" if self.shape.local_rope else "global"]
        return self

    def chunks(self, n: int):
        for start in range(0, n, self.chunk):
            yield slice(start, min(start + self.chunk, n))

    def tap_dim(self, tap: str, group: str | None = None) -> int:
        return self.shape.tap_dim(tap, group)

    def forward_weights(self, work: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.cdt) for k, v in work.items()}

    @staticmethod
    def linear(weights: dict[str, torch.Tensor], acts: dict[str, Callable]) -> block.Linear:
        def apply(name: str, x: torch.Tensor) -> torch.Tensor:
            fn = acts.get(name)
            if fn is not None:
                x = fn(x)
            return F.linear(x, weights[f"{name}.weight"], weights.get(f"{name}.bias"))

        return apply

    def buffers(self, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output (o_proj's input) and the MLP activation (down_proj's input)
        for every calibration token. They are never alive at the same time in the
        quantization pass, so they share one buffer sized for the larger."""
        n, t, _ = X.shape
        dims = (self.shape.heads * self.shape.head_dim, self.intermediate)
        if self._buffer is None:
            self._buffer = torch.empty(n * t * max(dims), dtype=self.cdt, device=self.device)
        attn = self._buffer[: n * t * dims[0]].view(n, t, dims[0])
        act = self._buffer[: n * t * dims[1]].view(n, t, dims[1])
        return attn, act

    def inputs(self, tap: str, X: torch.Tensor, fw: dict, linear: block.Linear,
               stats: TapStats | ExpertStats | None, advance: bool,
               observe_kv: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        """Run every chunk up to ``tap``'s input, feeding ``stats``.

        With ``advance`` the residual stream is updated in place on the way (the
        quantization pass: o_proj's output is added before mlp_in, down_proj's after
        mlp_act); without it X stays the layer input (the float smoothing pass).
        ``observe_kv`` sees the keys and values at ``attn_out``. A mixture of experts'
        taps feed an :class:`ExpertStats` per expert (``_moe_inputs``).
        """
        if self.shape.moe is not None and tap in ("mlp_in", "mlp_act", "out"):
            self._moe_inputs(tap, X, fw, linear, stats, advance)
            return
        A, Act = self.buffers(X)
        for c in self.chunks(X.shape[0]):
            if tap == "attn_in":
                h = block.attn_input(X[c], fw, self.shape)
            elif tap == "attn_out":
                h = block.attention(block.attn_input(X[c], fw, self.shape), fw, linear,
                                    self.shape, self.cos, self.sin, observe_kv)
                A[c] = h
            elif tap == "mlp_in":
                x2 = X[c] + block.attn_branch(A[c], fw, linear, self.shape)
                if advance:
                    X[c] = x2
                h = block.mlp_input(x2, fw, self.shape)
            elif tap == "mlp_act":
                x2 = X[c] if advance else X[c] + block.attn_branch(A[c], fw, linear, self.shape)
                h = block.mlp_act(block.mlp_input(x2, fw, self.shape), linear, self.shape)
                if advance:  # (the smoothing pass still reads A here and needs no Act)
                    Act[c] = h
            else:  # "out": the layer output
                X[c] += block.mlp_branch(Act[c], fw, linear, self.shape)
                continue
            if stats is not None:
                stats.add(h)

    def _moe_inputs(self, tap: str, X: torch.Tensor, fw: dict, linear: block.Linear,
                    stats: ExpertStats | None, advance: bool) -> None:
        """``inputs`` for a mixture of experts: no activation buffer (the experts' inputs
        are ragged); ``out`` runs the mixture again with every linear quantized."""
        A, _ = self.buffers(X)
        for c in self.chunks(X.shape[0]):
            if tap == "out":
                X[c] += block.moe_branch(block.mlp_input(X[c], fw, self.shape), fw, linear,
                                         self.shape)
                continue
            if tap == "mlp_in" or not advance:
                x2 = X[c] + block.attn_branch(A[c], fw, linear, self.shape)
                if advance:
                    X[c] = x2
            else:
                x2 = X[c]
            if stats is None:
                continue
            h = block.mlp_input(x2, fw, self.shape)
            if tap == "mlp_in":
                route_inputs(h, fw, self.shape.moe, stats, self.all_experts)
            else:
                moe_forward(h, fw, linear, self.shape.moe, stats, self.all_experts)

    def block_loss(self, tap: str, kinds: list[str], X: torch.Tensor, fw: dict,
                   tokens: int) -> BlockLoss | None:
        """The error of the attention block's (MLP's) output when the q/k/v (gate/up)
        weights are replaced, on the first ``tokens`` calibration tokens with the rest
        of the block in float; None for the taps with no such block (o_proj, down_proj).
        In the float pass, after ``inputs`` reached ``tap`` (A holds the attention)."""
        if tap not in ("attn_in", "mlp_in"):
            return None
        n = max(1, min(X.shape[0], tokens // X.shape[1]))
        A, _ = self.buffers(X)
        float_linear = self.linear(fw, {})
        if tap == "attn_in":
            h = block.attn_input(X[:n], fw, self.shape)

            def run(linear) -> torch.Tensor:
                a = block.attention(h, fw, linear, self.shape, self.cos, self.sin)
                return block.attn_branch(a, fw, float_linear, self.shape)
        else:
            h = block.mlp_input(X[:n] + block.attn_branch(A[:n], fw, float_linear, self.shape),
                                fw, self.shape)

            def run(linear) -> torch.Tensor:
                return block.mlp_branch(block.mlp_act(h, linear, self.shape), fw, float_linear,
                                        self.shape)

        reference = run(float_linear).float()

        def loss(effective: list[torch.Tensor]) -> float:
            weights = dict(fw)
            for k, w in zip(kinds, effective):
                weights[f"{k}.weight"] = w.to(self.cdt)
            return float((run(self.linear(weights, {})).float() - reference).pow(2).mean())

        return loss
