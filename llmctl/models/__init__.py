"""The model layer: references -> local checkpoints, metadata, loading.

Kept import-light: submodules pull in torch/transformers only when used.
"""
