"""coatstate: FP8 optimizer states and activations (COAT) for PyTorch training."""

from coatstate import formats
from coatstate.formats import FP8Format, GroupQuantized, dequantize, quantize

__version__ = "0.1.0"

__all__ = ["FP8Format", "GroupQuantized", "__version__", "dequantize", "formats", "quantize"]
