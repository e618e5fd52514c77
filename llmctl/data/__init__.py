"""Text sources shared by calibration (quantize) and evaluation (eval)."""
