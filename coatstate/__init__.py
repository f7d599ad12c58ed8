"""coatstate: FP8 optimizer states and activations (COAT) for PyTorch training."""

from coatstate import formats
from coatstate.activation_policy import ActivationPolicy, ActivationStats, Granularity, OpKind
from coatstate.activations import compress_activations
from coatstate.checkpoint import Checkpoint, CheckpointError, load, read, read_header, read_state_dict, save
from coatstate.formats import FP8Format, GroupQuantized, dequantize, quantize
from coatstate.nn import FP8Linear, FP8LinearConfig, convert_to_fp8, fp8_fallbacks
from coatstate.optim import (
    CompressedAdamW,
    compress_adamw_state_dict,
    optimizer_state_bytes,
    to_adamw_state_dict,
)

__version__ = "0.1.0"


def __getattr__(name: str):
    # CompiledActivations imports torch's inductor partitioner (~1 s): loaded on first use only
    if name == "CompiledActivations":
        from coatstate.activation_compile import CompiledActivations

        return CompiledActivations
    raise AttributeError(f"module 'coatstate' has no attribute {name!r}")


__all__ = [
    "ActivationPolicy",
    "ActivationStats",
    "Checkpoint",
    "CheckpointError",
    "CompiledActivations",
    "CompressedAdamW",
    "FP8Linear",
    "FP8LinearConfig",
    "Granularity",
    "OpKind",
    "compress_activations",
    "convert_to_fp8",
    "fp8_fallbacks",
    "load",
    "read",
    "read_header",
    "read_state_dict",
    "save",
    "FP8Format",
    "GroupQuantized",
    "__version__",
    "compress_adamw_state_dict",
    "dequantize",
    "formats",
    "optimizer_state_bytes",
    "quantize",
    "to_adamw_state_dict",
]
