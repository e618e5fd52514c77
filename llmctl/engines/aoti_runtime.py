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

from llmctl.engines.runtime import Runtime, SeqState, split_work

CHUNK = 64
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _round_up(n: int) -> int:
    return max(CHUNK, -(-n // CHUNK) * CHUNK)


class AotiState(SeqState):
    __slots__ = ("batch", "k", "row", "v")

    def __init__(self) -> None:
        super().__init__()
        self.k: torch.Tensor | None = None  # [L, 1, H, cap, d]
        self.v: torch.Tensor | None = None
        self.batch: _Batch | None = None
        self.row = -1

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batch is not None:
            r, n = self.row, self.length
            return self.batch.k[:, r:r + 1, :, :n], self.batch.v[:, r:r + 1, :, :n]
        assert self.k is not None and self.v is not None
        return self.k[:, :, :, :self.length], self.v[:, :, :, :self.length]

    def detach(self) -> None:
        if self.batch is not None:
            k, v = self.views()
            self.k, self.v = k.clone(), v.clone()
            self.batch, self.row = None, -1


class _Batch:
    def __init__(self, states: list[AotiState], k: torch.Tensor, v: torch.Tensor) -> None:
        self.states, self.k, self.v = states, k, v


class AotiRuntime(Runtime):
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
        self.dtype = _DTYPES[info["dtype"]]
        self.provider = "cpu (AOTInductor)"
        self._batch: _Batch | None = None

    def new_state(self) -> AotiState:
        return AotiState()

    def describe(self) -> dict:
        return {**super().describe(), "threads": self.threads, "dtype": str(self.dtype)}

    def _empty(self, batch: int, cap: int) -> torch.Tensor:
        return torch.zeros((self.num_layers, batch, self.kv_heads, cap, self.head_dim),
                           dtype=self.dtype)

    @torch.inference_mode()
    def forward(self, states: list[AotiState], chunks: list[list[int]],
                all_logits: bool = False) -> list[np.ndarray]:
        self._check(states, chunks)
        out: list[np.ndarray | None] = [None] * len(states)
        decode, single = split_work(chunks)
        for i in single:
            out[i] = self._run_one(states[i], chunks[i], all_logits)
        step = self.max_batch_size or len(decode) or 1
        for lo in range(0, len(decode), step):
            part = decode[lo:lo + step]
            rows = self._decode([states[i] for i in part], [chunks[i][0] for i in part])
            for j, i in enumerate(part):
                out[i] = rows[j:j + 1] if all_logits else rows[j]
        return out  # type: ignore[return-value]

    def _run_one(self, state: AotiState, chunk: list[int], all_logits: bool) -> np.ndarray:
        if state.batch is not None:
            self._leave_batch(state)
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

    def _leave_batch(self, state: AotiState) -> None:
        batch = state.batch
        if batch is not None and batch is self._batch:
            for s in batch.states:
                s.detach()
            self._batch = None
        else:
            state.detach()

    def _gather(self, states: list[AotiState]) -> _Batch:
        cap = _round_up(max(s.length for s in states) + 1)
        k, v = self._empty(len(states), cap), self._empty(len(states), cap)
        for row, s in enumerate(states):
            sk, sv = s.views()
            k[:, row:row + 1, :, :s.length] = sk
            v[:, row:row + 1, :, :s.length] = sv
        old = self._batch
        if old is not None:
            keep = {id(s) for s in states}
            for s in old.states:
                if id(s) not in keep and s.batch is old:
                    s.detach()
        batch = _Batch(list(states), k, v)
        for row, s in enumerate(states):
            s.k = s.v = None
            s.batch, s.row = batch, row
        return batch

    def _decode(self, states: list[AotiState], tokens: list[int]) -> np.ndarray:
        batch = self._batch
        if batch is None or len(batch.states) != len(states) or any(
                a is not b for a, b in zip(batch.states, states)):
            batch = self._batch = self._gather(states)
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
