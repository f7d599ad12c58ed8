"""coatstate: FP8 optimizer states and activations (COAT) for PyTorch training.

The entry points and their config and result types are here; everything else is reached through
its subpackage (coatstate.optim, .activations, .nn, .checkpoint, .planner, .formats, .kernels).
Names load on first use, so `import coatstate` (and the CLI's --help) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from coatstate._moved import install_moved_module_finder

__version__ = "0.2.0"

_EXPORTS = {
    "CompressedAdamW": "coatstate.optim",
    "CompressedSGD": "coatstate.optim",
    "CompressedLion": "coatstate.optim",
    "CompressedMuon": "coatstate.optim",
    "compress_activations": "coatstate.activations",
    "CompiledActivations": "coatstate.activations",
    "ActivationPolicy": "coatstate.activations",
    "ActivationStats": "coatstate.activations",
    "convert_to_fp8": "coatstate.nn",
    "cast_model": "coatstate.nn",
    "FP8Linear": "coatstate.nn",
    "FP8LinearConfig": "coatstate.nn",
    "save": "coatstate.checkpoint",
    "load": "coatstate.checkpoint",
    "read": "coatstate.checkpoint",
    "Checkpoint": "coatstate.checkpoint",
    "CheckpointError": "coatstate.checkpoint",
    "FP8Format": "coatstate.formats",
}
# names this namespace exported before 0.2, and where they live now
_MOVED = {
    "Granularity": "coatstate.activations",
    "OpKind": "coatstate.activations",
    "read_header": "coatstate.checkpoint",
    "read_state_dict": "coatstate.checkpoint",
    "GroupQuantized": "coatstate.formats",
    "quantize": "coatstate.formats",
    "dequantize": "coatstate.formats",
    "compress_adamw_state_dict": "coatstate.optim",
    "to_adamw_state_dict": "coatstate.optim",
    "optimizer_state_bytes": "coatstate.optim",
    "fp8_fallbacks": "coatstate.nn",
}

_SUBPACKAGES = frozenset({"optim", "activations", "nn", "checkpoint", "planner", "formats", "kernels", "cli"})

__all__ = [
    "ActivationPolicy",
    "ActivationStats",
    "Checkpoint",
    "CheckpointError",
    "CompiledActivations",
    "CompressedAdamW",
    "CompressedLion",
    "CompressedMuon",
    "CompressedSGD",
    "FP8Format",
    "FP8Linear",
    "FP8LinearConfig",
    "__version__",
    "cast_model",
    "compress_activations",
    "convert_to_fp8",
    "load",
    "read",
    "save",
]

install_moved_module_finder()


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"coatstate.{name}")
    if name in _MOVED:
        raise AttributeError(
            f"coatstate.{name} moved in 0.2: use `from {_MOVED[name]} import {name}` (CHANGELOG.md)"
        )
    raise AttributeError(f"module 'coatstate' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from coatstate.activations import (
        ActivationPolicy,
        ActivationStats,
        CompiledActivations,
        compress_activations,
    )
    from coatstate.checkpoint import Checkpoint, CheckpointError, load, read, save
    from coatstate.formats import FP8Format
    from coatstate.nn import FP8Linear, FP8LinearConfig, cast_model, convert_to_fp8
    from coatstate.optim import CompressedAdamW, CompressedLion, CompressedMuon, CompressedSGD
