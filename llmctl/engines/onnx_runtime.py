"""Run an ONNX decoder (onnxruntime-genai model-builder layout) with ONNX Runtime.

Graph contract (``genai_config.json`` names them)::

    inputs   input_ids [B, S] int64, attention_mask [B, total] int64,
             past_key_values.{i}.key / .value [B, kv_heads, past, head_dim]
    outputs  logits [B, S, vocab], present.{i}.key / .value [B, kv_heads, past + S, head_dim]

Attention is ONNX Runtime's ``GroupQueryAttention`` contrib op: it derives each row's
length from ``attention_mask`` (``seqlens_k = sum(mask) - 1``), takes RoPE positions
from those lengths, writes a row's new K/V at its own length and ignores the rest of
the buffer. So a batch of sequences of different lengths is one right-padded buffer
with a mask of ``[1] * length_b + [0] * padding``, and each decode step returns a
buffer one position longer (``past_present_share_buffer`` is off: ORT allocates the
present tensors, so every step copies the cache once; that is the cost of driving it
from Python without IO binding).

Execution providers: the session is created with the requested providers in order,
then ``session.get_providers()`` says what actually runs; onnxruntime silently drops
a provider whose libraries are missing (CUDA listed but a CPU session), so that is
what is reported and, with ``strict_provider``, refused.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np

from llmctl.engines.runtime import BatchedRuntime, BatchedState, DecodeBatch
from llmctl.errors import MissingDependencyError, ResourceError

log = logging.getLogger(__name__)

# --device / manifest name -> providers in preference order (CPU always last).
PROVIDERS: dict[str, list[str]] = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}
_NP_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


class OrtState(BatchedState):
    __slots__ = ("kv",)

    def __init__(self) -> None:
        super().__init__()
        self.kv: list[tuple[np.ndarray, np.ndarray]] | None = None  # own [1, H, L, d] arrays

    def views(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """This sequence's K/V per layer as ``[1, H, length, d]`` (views, no copy)."""
        if self.batch is not None:
            r, n = self.row, self.length
            return [(k[r:r + 1, :, :n], v[r:r + 1, :, :n]) for k, v in self.batch.kv]
        assert self.kv is not None
        n = self.length
        return [(k[:, :, :n], v[:, :, :n]) for k, v in self.kv]

    def _copy_out(self) -> None:
        self.kv = [(k.copy(), v.copy()) for k, v in self.views()]

    def _drop_own(self) -> None:
        self.kv = None


class _Batch(DecodeBatch):
    def __init__(self, states: list[OrtState], kv: list[tuple[np.ndarray, np.ndarray]]) -> None:
        super().__init__(states)
        self.kv = kv  # per layer (k, v) [B, H, width, d]


class OrtRuntime(BatchedRuntime):
    def __init__(self, path: Path, *, device: str = "cpu", threads: int | None = None,
                 strict_provider: bool = False, max_len: int | None = None,
                 max_batch_size: int | None = None, spin: bool | None = None) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise MissingDependencyError("running ONNX engines needs onnxruntime",
                                         "pip install 'llmctl[onnx]' (onnxruntime)") from None
        path = Path(path)
        genai = json.loads((path / "genai_config.json").read_text())["model"]
        dec = genai["decoder"]
        self.num_layers = dec["num_hidden_layers"]
        self.kv_heads = dec["num_key_value_heads"]
        self.head_dim = dec["head_size"]
        self.vocab_size = genai["vocab_size"]
        self.max_len = min(max_len or genai["context_length"], genai["context_length"])
        self.max_batch_size = max_batch_size
        self._in = dec["inputs"]
        self._out = dec["outputs"]

        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        if spin is not None:  # ORT's pool busy-waits by default: bad on a contended machine
            opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
        if device not in PROVIDERS:
            from llmctl.errors import UsageError

            raise UsageError(f"unknown ONNX device {device!r}",
                             f"use one of: {', '.join(PROVIDERS)}")
        available = set(ort.get_available_providers())
        wanted = [p for p in PROVIDERS[device] if p in available] or ["CPUExecutionProvider"]
        self.requested = PROVIDERS[device][0]
        self.session = ort.InferenceSession(str(path / dec["filename"]), sess_options=opts,
                                            providers=wanted)
        self.active_providers = list(self.session.get_providers())
        self.provider = self.active_providers[0]
        if self.provider != self.requested:
            message = (f"onnxruntime runs this engine on {self.provider}, not the requested "
                       f"{self.requested} (available: {', '.join(sorted(available))})")
            if strict_provider:
                raise ResourceError(message, "install the provider's libraries (CUDA, cuDNN, "
                                             "TensorRT) or open the engine with device='cpu'")
            log.warning("%s", message)
        types = {i.name: i.type for i in self.session.get_inputs()}
        self.kv_dtype = _NP_TYPES[types[self._in["past_key_names"] % 0]]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._logits_index = self.output_names.index(self._out["logits"])
        self._present_index = [
            (self.output_names.index(self._out["present_key_names"] % i),
             self.output_names.index(self._out["present_value_names"] % i))
            for i in range(self.num_layers)]
        self._batch: _Batch | None = None
        self.threads = threads or int(os.environ.get("OMP_NUM_THREADS", "0")) or None

    # --- the contract ----------------------------------------------------------------------
    def new_state(self) -> OrtState:
        state = OrtState()
        empty = np.zeros((1, self.kv_heads, 0, self.head_dim), dtype=self.kv_dtype)
        state.kv = [(empty, empty) for _ in range(self.num_layers)]
        return state

    def describe(self) -> dict:
        return {**super().describe(), "requested_provider": self.requested,
                "active_providers": self.active_providers,
                "kv_dtype": np.dtype(self.kv_dtype).name, "threads": self.threads}

    # --- internals -------------------------------------------------------------------------
    def _feeds(self, ids: np.ndarray, mask: np.ndarray, kv) -> dict:
        feeds = {self._in["input_ids"]: ids, self._in["attention_mask"]: mask}
        for i, (k, v) in enumerate(kv):
            feeds[self._in["past_key_names"] % i] = k
            feeds[self._in["past_value_names"] % i] = v
        return feeds

    def _run(self, ids, mask, kv) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
        res = self.session.run(self.output_names, self._feeds(ids, mask, kv))
        return res[self._logits_index], [(res[a], res[b]) for a, b in self._present_index]

    def _prefill(self, state: OrtState, chunk: list[int], all_logits: bool) -> np.ndarray:
        total = state.length + len(chunk)
        ids = np.asarray([chunk], dtype=np.int64)
        mask = np.ones((1, total), dtype=np.int64)
        logits, state.kv = self._run(ids, mask, state.views())
        state.length = total
        return logits[0].astype(np.float32) if all_logits else logits[0, -1].astype(np.float32)

    def _gather(self, states: list[OrtState]) -> _Batch:
        """A new right-padded buffer holding ``states`` in order (copies each row once)."""
        width = max(s.length for s in states)
        b = len(states)
        kv = []
        views = [s.views() for s in states]
        for layer in range(self.num_layers):
            k = np.zeros((b, self.kv_heads, width, self.head_dim), dtype=self.kv_dtype)
            v = np.zeros_like(k)
            for row, s in enumerate(states):
                sk, sv = views[row][layer]
                k[row, :, :s.length] = sk[0]
                v[row, :, :s.length] = sv[0]
            kv.append((k, v))
        return _Batch(states, kv)

    def _decode(self, batch: _Batch, states: list[OrtState], tokens: list[int]) -> np.ndarray:
        width = batch.kv[0][0].shape[2] + 1
        lengths = np.asarray([s.length for s in states])
        mask = (np.arange(width)[None, :] <= lengths[:, None]).astype(np.int64)
        ids = np.asarray(tokens, dtype=np.int64)[:, None]
        logits, batch.kv = self._run(ids, mask, batch.kv)
        for s in states:
            s.length += 1
        return logits[:, 0].astype(np.float32)
