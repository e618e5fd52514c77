"""``llmctl quantize``: weight (and activation) quantization into compressed-tensors.

Layout, imports flowing one way:

- algorithm modules, tensors in / tensors out: ``rtn`` (round-to-nearest integer grids),
  ``fp8`` (E4M3), ``packing`` (int32 bit packing), ``gptq``, ``awq``, ``smoothquant``;
- methods as plug-ins: ``method`` (the hooks a recipe modifier supplies: statistics,
  smoothing, weight quantization), ``methods`` (one per modifier, and the registry
  mapping modifier types to them);
- plumbing: ``recipe`` (YAML -> validated modifiers), ``plan`` (scheme per module, group
  sizes, expected size), ``calibration`` (token windows), ``memory`` (peak estimate),
  ``checkpoint`` / ``block`` (lazy safetensors reader, functional decoder block),
  ``stats`` (per-tap calibration statistics), ``scheme`` (a scheme's grids and
  activation fake-quantizers), ``stream`` (a layer's activations run up to each tap),
  ``smoothing`` (the float pass folding a smoother's scales), ``pipeline``
  (layer-by-layer execution), ``writer`` (compressed-tensors output), ``reference``
  (dequantized reference model), ``report`` (per-layer table).
"""
