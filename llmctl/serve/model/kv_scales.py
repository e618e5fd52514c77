"""Static scales of an fp8 (E4M3) KV cache: from the checkpoint, or calibrated.

An fp8 cache (:mod:`llmctl.serve.layers.kv_quant`) divides every K (V) value of a KV head by a
fixed scale ``s``, ``[layers, 2, kv_heads]`` float32, so it needs them before the first
token is written:

- **checkpoint**: a compressed-tensors ``kv_cache_scheme`` (llm-compressor, vLLM's
  format) stores ``model.layers.N.self_attn.k_scale`` and ``v_scale``; one value per layer
  (``strategy: tensor``) or one per KV head (``attn_head``). Used as they are.
- **calibrated**: otherwise the model runs a short prompt set (``_calibration_spec``, the
  built-in calibration text, never the held-out text ``llmctl eval`` scores) into a
  bf16/float cache and takes, per layer, K or V and KV head (or per layer: ``granularity
  "layer"``), the largest magnitude written: post-RoPE keys, as the cache holds them.

      s = 2 * amax / 448     (llmctl.quant.fp8.kv_cache_scales, as `llmctl quantize` writes)

  E4M3 has the same relative precision (3 mantissa bits) from 2^-6 to 448, so headroom
  costs nothing until values fall below 2^-6 s (amax / 57344), while a value past the
  calibrated range saturates. vLLM's ``--calculate-kv-scales`` takes amax / 200 for K
  and / 100 for V from the first batch, the same idea with more margin.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import torch

from llmctl.quant.fp8 import kv_cache_scales
from llmctl.serve.layers.attention import AttnGroup, AttnMetadata

log = logging.getLogger("llmctl.serve")

Granularity = Literal["head", "layer"]


def _calibration_spec(max_len: int = 64):
    from llmctl.quant.calibration import CalibrationSpec

    # 64 windows of 64 tokens: ~4K tokens, 1.5 s for SmolLM2 on 2 cores. Short windows so
    # that the scales do not depend on --max-model-len (which bounds the positions the
    # model computes) above 64; K/V magnitudes do not grow with position (RoPE rotates
    # pairs, V has no position).
    return CalibrationSpec(samples=64, seq_len=min(64, max_len), seed=0)


def checkpoint_kv_scales(path: Path, num_layers: int, num_kv_heads: int) -> torch.Tensor | None:
    """``[layers, 2, kv_heads]`` from the checkpoint's ``self_attn.k_scale / v_scale``
    tensors, or None when it has none. A checkpoint with scales for some layers only, or
    of a shape that is neither one value nor one per KV head, is refused."""
    from llmctl.errors import NotAModelError
    from llmctl.serve.model.weights import CheckpointReader

    try:
        reader = CheckpointReader(Path(path))
    except NotAModelError:
        return None
    names = [f"model.layers.{i}.self_attn.{kv}_scale" for i in range(num_layers)
             for kv in ("k", "v")]
    present = [n in reader for n in names]
    if not any(present):
        return None
    if not all(present):
        missing = names[present.index(False)]
        raise NotAModelError(f"the checkpoint's KV cache scales are incomplete: no {missing!r}",
                             "re-export the model with its kv_cache_scheme, or drop the "
                             "scales to calibrate them")
    scales = torch.empty((num_layers, 2, num_kv_heads), dtype=torch.float32)
    for index, name in enumerate(names):
        value = reader(name).float().flatten()
        if value.numel() not in (1, num_kv_heads) or not torch.all(value > 0):
            raise NotAModelError(f"{name} holds {value.numel()} values (need 1 or one per KV "
                                 f"head, {num_kv_heads}, all positive)",
                                 "re-export the model with its kv_cache_scheme")
        scales[index // 2, index % 2] = value
    return scales


def calibrate_kv_scales(model, windows: torch.Tensor, granularity: Granularity = "head",
                        block_size: int = 16, batch: int = 4) -> torch.Tensor:
    """``[layers, 2, kv_heads]`` scales from running ``windows [n, L]`` token ids through
    ``model`` (:class:`llmctl.serve.model.decoder.LlamaModel`) as fresh prompts into a float cache
    of the model's dtype."""
    spec = model.spec
    nkv, d = spec.num_kv_heads, spec.head_dim
    amax = torch.zeros((spec.num_layers, 2, nkv), dtype=torch.float32)
    length = windows.shape[1]
    for first in range(0, windows.shape[0], batch):
        ids = windows[first:first + batch]
        n = ids.shape[0]
        tokens = n * length
        blocks = -(-tokens // block_size)
        with torch.inference_mode():
            cache = torch.zeros((spec.num_layers, 2, blocks, block_size, nkv, d),
                                dtype=model.dtype, device=model.device)
            meta = AttnMetadata(slot_mapping=torch.arange(tokens, device=model.device),
                                groups=[AttnGroup(start=0, end=tokens, num_seqs=n,
                                                  q_len=length, fresh=True)])
            positions = torch.arange(length).repeat(n).to(model.device)
            model.forward(ids.flatten().to(model.device), positions, meta, cache)
            written = cache.view(spec.num_layers, 2, -1, nkv, d)[:, :, :tokens]
            seen = written.abs().amax(dim=(2, 4)).float().cpu()
        # outside inference mode: a plain tensor (the engine may update its scales)
        amax = torch.maximum(amax, seen.clone())
    if granularity == "layer":
        amax = amax.amax(dim=2, keepdim=True).expand(-1, -1, nkv)
    return kv_cache_scales(amax).contiguous()


def fp8_kv_scales(path: Path, model, tokenizer, granularity: Granularity = "head",
                  max_len: int = 64) -> tuple[torch.Tensor, str]:
    """The scales an fp8 cache of this model uses, and where they came from (logged);
    ``max_len``: the longest sequence the model computes."""
    spec = model.spec
    scales = checkpoint_kv_scales(path, spec.num_layers, spec.num_kv_heads)
    if scales is not None:
        per_head = bool((scales != scales[:, :, :1]).any())
        source = f"the checkpoint's kv_cache_scheme ({'per head' if per_head else 'per layer'})"
    else:
        from llmctl.quant.calibration import build_calibration

        calib = build_calibration(tokenizer, _calibration_spec(max_len))
        scales = calibrate_kv_scales(model, calib.ids, granularity)
        source = (f"calibrated per {granularity} over {calib.tokens} tokens of "
                  f"{calib.spec.source}")
    log.info("fp8 KV cache scales: %s", source)
    return scales.to(model.device), source
