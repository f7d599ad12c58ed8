"""Saved activations held in FP8 until backward: eager hooks (compress_activations) and the
torch.compile partitioner (CompiledActivations), with their policy, op kinds and stats."""

from typing import Any

from coatstate.activations.hooks import compress_activations
from coatstate.activations.op_kinds import OpKind
from coatstate.activations.policy import KEEP_ALL, ActivationPolicy, Granularity
from coatstate.activations.stats import ActivationStats, KeepReason

__all__ = [
    "KEEP_ALL",
    "ActivationPolicy",
    "ActivationStats",
    "CompiledActivations",
    "Granularity",
    "KeepReason",
    "OpKind",
    "compress_activations",
]


def __getattr__(name: str) -> Any:
    # CompiledActivations imports torch's inductor partitioner (about a second): on first use only
    if name == "CompiledActivations":
        from coatstate.activations.compiled import CompiledActivations

        return CompiledActivations
    raise AttributeError(f"module 'coatstate.activations' has no attribute {name!r}")
