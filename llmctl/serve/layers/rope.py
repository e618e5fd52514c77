"""The engine's RoPE: the shared tables and rotation of :mod:`llmctl.models.layers.rope`
in the interleaved-pairs layout, and what the engine refuses.

The engine permutes q/k projection rows into interleaved pairs (:func:`interleave_rows`)
so RoPE is one complex multiplication (:func:`apply_rope`), and its native kernel
(:class:`llmctl.serve.kernels.cpu.RopeKV`) reads the same :func:`rope_freqs` table. It
rotates whole heads: partial rotary is refused here, not computed wrong.
"""

from __future__ import annotations

import torch

from llmctl.errors import UnsupportedArchitectureError
from llmctl.models.layers.rope import (  # noqa: F401 (the engine's names for them)
    ROPE_TYPES,
    rope_cos_sin,
    rope_freqs,
)
from llmctl.models.layers.rope import rotate_pairs as apply_rope  # noqa: F401
from llmctl.models.spec import ModelArch, partial_rotary, rope_settings


def rope_parameters(config: dict) -> dict:
    """The RoPE settings of an HF config.json, old (``rope_scaling``) or new layout."""
    _check_full_rotary(partial_rotary(config))
    return rope_settings(config)


def check_rope(arch: ModelArch) -> None:
    """Refuse what the engine's RoPE does not compute."""
    _check_full_rotary(arch.partial_rotary_factor)


def _check_full_rotary(factor: float) -> None:
    if factor != 1.0:
        raise UnsupportedArchitectureError("partial rotary embeddings are not supported",
                                           "use a model that rotates the whole head")


def interleave_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder q/k projection rows from HF's halves layout to interleaved pairs.

    HF rotates dimension ``i`` of a head with ``i + d/2``; after this permutation the
    pair sits at ``(2i, 2i + 1)`` and RoPE is one complex multiplication. Attention only
    needs ``q . k``, which is unchanged when q and k share the permutation; V is not
    touched. (llama.cpp's converter applies the same permutation for the same reason.)
    """
    from llmctl.models.architectures import rope_permute

    return rope_permute(weight, num_heads)
