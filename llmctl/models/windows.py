"""Sliding windows per layer: one rule per way transformers reads them from config.json
(a family row names its rule in ``Family.windows``; :class:`llmctl.models.spec.ModelArch`
applies it). A rule returns one window (tokens) or None (full attention) per layer."""

from __future__ import annotations

import logging

from llmctl.errors import UnsupportedArchitectureError

log = logging.getLogger("llmctl.models")

# layer_types entry -> whether the layer attends through the sliding window
LAYER_TYPES = {"full_attention": False, "sliding_attention": True}


def _window(value) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UnsupportedArchitectureError(
            f"config.json's sliding_window {value!r} is not a positive token count",
            "fix the checkpoint's config.json")
    return value


def _no_windows(config: dict, num_layers: int) -> tuple[int | None, ...]:
    # transformers' Llama has no sliding window: a ``sliding_window`` key in its config is
    # not read there either (llmctl computes what the reference computes)
    if config.get("sliding_window"):
        log.warning("config.json sets sliding_window=%s for model_type %r, whose "
                    "transformers implementation attends fully: so does llmctl",
                    config["sliding_window"], config.get("model_type"))
    return (None,) * num_layers


def _every_layer(config: dict, num_layers: int) -> tuple[int | None, ...]:
    # MistralModel masks every layer with config.sliding_window (null: full attention)
    return (_window(config.get("sliding_window")),) * num_layers


def _by_layer_type(config: dict, num_layers: int) -> tuple[int | None, ...]:
    # Qwen2Config: sliding_window only counts with use_sliding_window; layer_types, when
    # absent, is "sliding_attention" for i >= max_window_layers (transformers' default 28)
    window = _window(config.get("sliding_window")) if config.get("use_sliding_window") \
        else None
    types = config.get("layer_types") or [
        "sliding_attention" if window is not None and i >= config.get("max_window_layers", 28)
        else "full_attention" for i in range(num_layers)]
    return _typed(types, window, num_layers)


def _alternating(config: dict, num_layers: int) -> tuple[int | None, ...]:
    # Gemma 2/3 always window their local layers: layer_types, else the old configs'
    # pattern (every n-th layer global: Gemma 2 n = 2 from layer 1, Gemma 3 n = 6)
    window = _window(config.get("sliding_window"))
    pattern = int(config.get("sliding_window_pattern") or 2)
    types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(num_layers)]
    return _typed(types, window, num_layers)


def _typed(types: list, window: int | None, num_layers: int) -> tuple[int | None, ...]:
    unknown = set(types) - set(LAYER_TYPES)
    if len(types) != num_layers or unknown:
        raise UnsupportedArchitectureError(
            f"config.json's layer_types {types} do not name one of "
            f"{', '.join(LAYER_TYPES)} per layer ({num_layers})",
            "llmctl runs full and sliding-window attention layers only")
    return tuple(window if LAYER_TYPES[t] else None for t in types)


def _not_read(config: dict, num_layers: int) -> tuple[int | None, ...]:
    # the windows of a type outside the table are not read
    return ()


WINDOW_RULES = {"none": _no_windows, "every_layer": _every_layer,
                "layer_types": _by_layer_type, "alternating": _alternating,
                "unknown": _not_read}
