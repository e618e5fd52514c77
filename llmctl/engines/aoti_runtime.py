"""Run an AOTInductor package of :class:`~llmctl.engines.static_decoder.StaticDecoder`.

``torch._inductor.aoti_load_package`` maps the compiled shared library and its weights;
nothing is traced or compiled at load time (a fresh process loads in about a second).

Cache layout: one sequence owns ``k, v [L, 1, Hkv, cap, d]``; a decode batch owns
``[L, B, Hkv, cap, d]`` with row ``b`` valid up to ``length_b``. ``cap`` grows in
chunks of :data:`CHUNK` slots, and the compiled graph takes the whole buffer (its cache
dimension is dynamic), so attention costs O(cap) per token rather than O(max_len).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from llmctl.engines.runtime import BatchedRuntime, BatchedState, DecodeBatch
from llmctl.utils.dtypes import torch_dtype

CHUNK = 64


def _round_up(n: int) -> int:
    return max(CHUNK, -(-n // CHUNK) * CHUNK)


class AotiState(BatchedState):
    __slots__ = ("k", "v")

    def __init__(self) -> None:
        super().__init__()
        self.k: torch.Tensor | None = None  # [L, 1, H, cap, d]
        self.v: torch.Tensor | None = None

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batch is not None:
            r, n = self.row, self.length
            return self.batch.k[:, r:r + 1, :, :n], self.batch.v[:, r:r + 1, :, :n]
        assert self.k is not None and self.v is not None
        return self.k[:, :, :, :self.length], self.v[:, :, :, :self.length]

    def _copy_out(self) -> None:
        k, v = self.views()
        self.k, self.v = k.clone(), v.clone()

    def _drop_own(self) -> None:
        self.k = self.v = None


class _Batch(DecodeBatch):
    def __init__(self, states: list[AotiState], k: torch.Tensor, v: torch.Tensor) -> None:
        super().__init__(states)
        self.k, self.v = k, v  # [L, B, H, cap, d]


class AotiRuntime(BatchedRuntime):
    def __init__(self, path: Path, info: dict, *, threads: int | None = None,
                 max_batch_size: int | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()
        self.model = torch._inductor.aoti_load_package(str(Path(path) / info["package"]))
        self.num_layers = info["num_layers"]
        self.kv_heads = info["num_kv_heads"]
        self.head_dim = info["head_dim"]
        self.vocab_size = info["vocab_size"]
        self.max_len = info["max_seq_len"]
        self.max_batch_size = min(max_batch_size or info["max_batch_size"], info["max_batch_size"])
        self.dtype = torch_dtype(info["dtype"])
        self.provider = "cpu (AOTInductor)"
        self._batch: _Batch | None = None

    def new_state(self) -> AotiState:
        return AotiState()

    def describe(self) -> dict:
        return {**super().describe(), "threads": self.threads, "dtype": str(self.dtype)}

    def _empty(self, batch: int, cap: int) -> torch.Tensor:
        return torch.zeros((self.num_layers, batch, self.kv_heads, cap, self.head_dim),
                           dtype=self.dtype)

    @torch.inference_mode()  # the whole step, cache copies included: no autograd state
    def forward(self, states: list[AotiState], chunks: list[list[int]],
                all_logits: bool = False) -> list[np.ndarray]:
        return super().forward(states, chunks, all_logits)

    def _prefill(self, state: AotiState, chunk: list[int], all_logits: bool) -> np.ndarray:
        n, t = state.length, len(chunk)
        if n == 0:  # nothing cached: a one-slot dummy cache, masked out entirely
            k_in = v_in = self._empty(1, 1)
        else:
            k_in, v_in = state.k, state.v
        ids = torch.tensor([chunk], dtype=torch.long)
        logits, k_new, v_new = self.model(ids, torch.tensor([n]), k_in, v_in)
        cap = state.k.shape[3] if state.k is not None else 0
        if n + t > cap:
            k, v = self._empty(1, _round_up(n + t)), self._empty(1, _round_up(n + t))
            if n:
                k[:, :, :, :n], v[:, :, :, :n] = state.k[:, :, :, :n], state.v[:, :, :, :n]
            state.k, state.v = k, v
        state.k[:, :, :, n:n + t] = k_new
        state.v[:, :, :, n:n + t] = v_new
        state.length = n + t
        return (logits[0] if all_logits else logits[0, -1]).numpy()

    def _gather(self, states: list[AotiState]) -> _Batch:
        cap = _round_up(max(s.length for s in states) + 1)
        k, v = self._empty(len(states), cap), self._empty(len(states), cap)
        for row, s in enumerate(states):
            sk, sv = s.views()
            k[:, row:row + 1, :, :s.length] = sk
            v[:, row:row + 1, :, :s.length] = sv
        return _Batch(states, k, v)

    def _decode(self, batch: _Batch, states: list[AotiState], tokens: list[int]) -> np.ndarray:
        lengths = torch.tensor([s.length for s in states])
        if int(lengths.max()) + 1 > batch.k.shape[3]:  # grow by one chunk
            cap = _round_up(int(lengths.max()) + 1)
            k, v = self._empty(len(states), cap), self._empty(len(states), cap)
            k[:, :, :, :batch.k.shape[3]] = batch.k
            v[:, :, :, :batch.v.shape[3]] = batch.v
            batch.k, batch.v = k, v
        ids = torch.tensor(tokens, dtype=torch.long)[:, None]
        logits, k_new, v_new = self.model(ids, lengths, batch.k, batch.v)
        rows = torch.arange(len(states))
        # advanced indices on dims 1 and 3 move to the front: [B, L, H, d]
        batch.k[:, rows, :, lengths] = k_new[:, :, :, 0].permute(1, 0, 2, 3)
        batch.v[:, rows, :, lengths] = v_new[:, :, :, 0].permute(1, 0, 2, 3)
        for s in states:
            s.length += 1
        return logits[:, 0].numpy()
