"""The model layer: references -> local checkpoints, metadata, loading.

A ``.gguf`` reference (the embedded model is one) is read by ``gguf_reader`` and turned
into a checkpoint by ``gguf_import``; writing GGUF is :mod:`llmctl.gguf`'s, above this.

Kept import-light: submodules pull in torch/transformers only when used.
"""
