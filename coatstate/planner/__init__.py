"""`coatstate plan`'s engine: memory per GPU of a training job, with and without compression.

Loaded on first use (it imports torch), so that the CLI can import coatstate.planner.units alone.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "plan": "coatstate.planner.planning",
    "resolve_model": "coatstate.planner.planning",
    "spec_from_factory": "coatstate.planner.planning",
    "ModelSpec": "coatstate.planner.planning",
    "Plan": "coatstate.planner.memory",
    "Row": "coatstate.planner.memory",
    "Variant": "coatstate.planner.memory",
    "optimizer_bytes": "coatstate.planner.memory",
    "ActivationModel": "coatstate.planner.trace",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'coatstate.planner' has no attribute {name!r}")
