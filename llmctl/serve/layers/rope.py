"""The engine's RoPE: the shared tables and rotation of :mod:`llmctl.models.layers.rope`
in the interleaved-pairs layout, and what the engine refuses.

The engine permutes q/k projection rows into interleaved pairs (:func:`interleave_rows`)
so RoPE is one complex multiplication (:func:`apply_rope`), and its native kernel
(:class:`llmctl.serve.kernels.cpu.RopeKV`) reads the same :func:`rope_freqs` table.
Partial rotary: only the first ``rotary_dim`` dimensions of a head are reordered and
rotated.
"""

from __future__ import annotations

from llmctl.errors import UnsupportedArchitectureError
from llmctl.models.layers.registry import lookup
from llmctl.models.layers.rope import (  # noqa: F401 (the engine's names for them)
    ROPE_TYPES,
    interleave_rows,
    rope_cos_sin,
    rope_freqs,
    rotary_dim,
)
from llmctl.models.layers.rope import rotate_pairs as apply_rope  # noqa: F401
from llmctl.models.spec import ModelArch, rope_settings


def rope_parameters(config: dict) -> dict:
    """The RoPE settings of an HF config.json, old (``rope_scaling``) or new layout."""
    return rope_settings(config)


def check_rope(arch: ModelArch) -> None:
    """Refuse what the engine's RoPE does not compute: a RoPE type outside the table."""
    rotated = rotary_dim(arch.head_dim, arch.partial_rotary_factor)
    if rotated % 2 or not 0 < rotated <= arch.head_dim:
        raise UnsupportedArchitectureError(
            f"partial_rotary_factor {arch.partial_rotary_factor} rotates {rotated} of "
            f"{arch.head_dim} dimensions", "RoPE needs an even number of them; fix config.json")
    for params in (arch.rope, arch.local_rope):
        if params is not None:
            lookup(ROPE_TYPES, params["rope_type"], "RoPE type")
