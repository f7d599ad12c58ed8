"""coatstate: FP8 optimizer states and activations (COAT) for PyTorch training.

The entry points and their config and result types are here; everything else is reached through
its subpackage (coatstate.optim, .activations, .nn, .checkpoint, .planner, .formats, .kernels).
Names load on first use, so `import coatstate` (and the CLI's --help) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

_EXPORTS = {
    "CompressedAdamW": "coatstate.optim",
    "CompressedSGD": "coatstate.optim",
    "CompressedLion": "coatstate.optim",
    "CompressedMuon": "coatstate.optim",
    "HostOffloadAdamW": "coatstate.optim",
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
    "HostOffloadAdamW",
    "__version__",
    "cast_model",
    "compress_activations",
    "convert_to_fp8",
    "load",
    "read",
    "save",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"coatstate.{name}")
    raise AttributeError(f"module 'coatstate' has no attribute {name!r}")


def __dir__() -> list[str]:
    # the public names and subpackages, not this module's own imports (importlib, Any)
    dunders = {n for n in globals() if n.startswith("__") and n.endswith("__")}
    return sorted(set(__all__) | _SUBPACKAGES | dunders)


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
    from coatstate.optim import (
        CompressedAdamW,
        CompressedLion,
        CompressedMuon,
        CompressedSGD,
        HostOffloadAdamW,
    )
