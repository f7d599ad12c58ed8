"""FP8Linear: nn.Linear with FP8 GEMMs and an FP8 saved input, and the converter for a model."""

from coatstate.nn.cast import cast_model
from coatstate.nn.config import FP8LinearConfig
from coatstate.nn.convert import convert_to_fp8, fp8_fallbacks
from coatstate.nn.module import FP8Linear

__all__ = ["FP8Linear", "FP8LinearConfig", "cast_model", "convert_to_fp8", "fp8_fallbacks"]
