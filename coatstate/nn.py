"""Layers: FP8Linear and the converter that puts it into an existing model (coatstate/fp8_linear.py)."""

from coatstate.fp8_linear import FP8Linear, FP8LinearConfig, convert_to_fp8, fp8_fallbacks

__all__ = ["FP8Linear", "FP8LinearConfig", "convert_to_fp8", "fp8_fallbacks"]
