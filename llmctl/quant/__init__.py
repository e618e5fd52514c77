"""``llmctl quantize``: weight (and activation) quantization into compressed-tensors.

Layout, imports flowing one way:

- algorithm modules, tensors in / tensors out: ``rtn`` (round-to-nearest integer grids),
  ``fp8`` (E4M3), ``packing`` (int32 bit packing), ``gptq``, ``awq``, ``smoothquant``;
- plumbing: ``recipe`` (YAML -> validated modifiers), ``plan`` (scheme per module, group
  sizes, expected size), ``calibration`` (token windows), ``memory`` (peak estimate),
  ``checkpoint`` / ``block`` (lazy safetensors reader, functional decoder block),
  ``pipeline`` (layer-by-layer execution), ``writer`` (compressed-tensors output),
  ``reference`` (dequantized reference model), ``report`` (per-layer table).
"""
