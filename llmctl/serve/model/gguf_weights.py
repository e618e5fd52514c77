"""A GGUF file's weights for the engine, quantized tensors kept quantized.

Q4_0, Q4_1 and Q8_0 blocks become :class:`llmctl.serve.layers.lowbit.AffineCodes` with groups of
32, bit for bit: the codes, scales and offsets :meth:`llmctl.gguf.quants.LegacyBlock.codes`
reads (``w = d * q + z``; the block layouts are drawn there), run on the low-bit kernel as
llama.cpp runs them: no float copy of a quantized matrix. Other types (F32, F16, BF16,
K-quants, i-quants, Q5_* whose 5-bit codes the kernel does not take) are dequantized once,
at load, by gguf-py; a type it cannot read raises an error naming the type.
Names and values are Hugging Face's: q/k rows come back in HF order (the engine applies its
own RoPE interleaving, which is the permutation llama.cpp's converter stored), Gemma's norm
weights without the +1 llama.cpp's converter added
(:func:`llmctl.models.architectures.from_gguf`). A mixture of experts' stacked
``ffn_*_exps`` tensors answer for the per-expert names (:mod:`llmctl.models.gguf_experts`),
each expert dequantized from its own slice: the engine's experts run in float; gpt-oss's
answer for its fused ``gate_up_proj``/``down_proj`` (and ``_bias``), joined from their cuts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from llmctl.errors import GGUFError
from llmctl.gguf.quants import QUANTS
from llmctl.models import gguf_experts
from llmctl.models.architectures import from_gguf, rope_unpermute
from llmctl.models.gguf_reader import open_checkpoint
from llmctl.serve.layers.lowbit import AffineCodes

# The legacy types whose codes the low-bit kernel runs as they are (4 and 8 bits).
CODECS = {name: QUANTS[name] for name in ("Q4_0", "Q4_1", "Q8_0")}


def decode_blocks(raw: np.ndarray, type_name: str, rows: int, cols: int) -> AffineCodes:
    """A quantized GGUF tensor's bytes as codes with per-32 scales and offsets."""
    codec = CODECS[type_name]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // codec.block_size,
                                                     codec.type_size)
    q, d, z = codec.codes(blocks)
    return AffineCodes(
        q=torch.from_numpy(np.ascontiguousarray(q).reshape(rows, cols)),
        scale=torch.from_numpy(d), zero=None if z is None else torch.from_numpy(z),
        group_size=codec.block_size, bits=codec.bits)


class GGUFWeights:
    """``reader(hf_name) -> float tensor``; :meth:`layer_weight` keeps codes."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._ckpt = open_checkpoint(self.path)
        config = self._ckpt.config
        by_gguf = {t.name: t for t in self._ckpt.reader.tensors}
        self._tensors = {hf: by_gguf[g] for g, hf in self._ckpt.hf_names().items()
                         if g in by_gguf}
        # a MoE's per-expert name -> (its stacked tensor, its slice): experts run in float,
        # so each is dequantized alone from its own bytes (not the whole stack E times)
        self._experts = {hf: (by_gguf[g], e) for g, parts in self._ckpt.expert_names().items()
                         if g in by_gguf for e, hf in enumerate(parts)}
        # gpt-oss: a fused HF tensor -> its cuts (gate and up, or the whole of down)
        self._fused: dict[str, list] = {}
        for g, cut in self._ckpt.cut_names().items():
            if g in by_gguf:
                self._fused.setdefault(cut.source, []).append((by_gguf[g], cut))
        self._heads = {"q_proj": config["num_attention_heads"],
                       "k_proj": config["num_key_value_heads"]}

    def __contains__(self, name: str) -> bool:
        return name in self._tensors or name in self._experts or name in self._fused

    def _entry(self, name: str):
        try:
            return self._tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path.name} has no tensor for {name!r}",
                            "the file does not match its own metadata; re-export it") from None

    def _unpermute_heads(self, name: str) -> int | None:
        if not self._ckpt.arch.rope_permute:
            return None
        return self._heads.get(name.rsplit(".", 2)[-2]) if name.endswith(".weight") else None

    def _dequantize(self, t, raw) -> np.ndarray:
        import gguf

        try:
            return np.asarray(gguf.quants.dequantize(raw, t.tensor_type), dtype=np.float32)
        except NotImplementedError:
            raise GGUFError(f"{self.path.name}: tensor {t.name} is {t.tensor_type.name}, "
                            "which gguf-py cannot dequantize",
                            "re-export the model with a float, legacy, K- or i-quant type"
                            ) from None

    def __call__(self, name: str) -> torch.Tensor:
        if name in self._fused:
            cuts = [(cut, self._dequantize(t, t.data).reshape(tuple(map(int, reversed(t.shape)))))
                    for t, cut in self._fused[name]]
            return torch.from_numpy(gguf_experts.join(cuts))
        if name in self._experts:
            t, e = self._experts[name]
            cols, rows, n = (int(d) for d in t.shape)
            part = np.asarray(t.data).reshape(n, -1)[e]  # expert e's rows, as stored
            return torch.from_numpy(self._dequantize(t, part).reshape(rows, cols).copy())
        t = self._entry(name)
        shape = tuple(int(d) for d in reversed(t.shape))
        array = from_gguf(self._ckpt.arch, name, self._dequantize(t, t.data).reshape(shape),
                          self._heads["q_proj"], self._heads["k_proj"])
        return torch.from_numpy(np.array(array, order="C"))

    def layer_weight(self, name: str) -> torch.Tensor | AffineCodes:
        """A linear layer's ``{name}.weight``: codes for Q4_0/Q4_1/Q8_0, else float."""
        full = f"{name}.weight"
        if full in self._experts:
            return self(full)
        t = self._entry(full)
        if t.tensor_type.name not in CODECS:
            return self(full)
        cols, rows = (int(d) for d in t.shape)
        codes = decode_blocks(t.data, t.tensor_type.name, rows, cols)
        heads = self._unpermute_heads(full)
        return codes.map_rows(lambda t: rope_unpermute(t, heads)) if heads else codes
