"""Modules that moved when the package was split into subpackages (0.2): importing an old path
raises an ImportError that names the new one, instead of a bare ModuleNotFoundError."""

from __future__ import annotations

import importlib.abc
import sys

MOVED_MODULES = {
    "coatstate.fp8_linear": "coatstate.nn",
    "coatstate.optim.optim": "coatstate.optim",
    "coatstate.activation_policy": "coatstate.activations (policy, op kinds, stats) and coatstate.formats.activation (the codec)",
    "coatstate.activation_compile": "coatstate.activations (CompiledActivations)",
    "coatstate.activation_graph": "coatstate.activations.graph",
    "coatstate.activation_regions": "coatstate.activations.regions",
    "coatstate.checkpoint_io": "coatstate.checkpoint.container and coatstate.checkpoint.storage",
    "coatstate.planner_cli": "coatstate.cli.plan",
    "coatstate.planner_memory": "coatstate.planner.memory",
    "coatstate.planner_models": "coatstate.planner.models",
    "coatstate.planner_trace": "coatstate.planner.trace",
    "coatstate.kernels.adamw_twin": "coatstate.optim.reference_step and coatstate.formats.optimizer_state",
    "coatstate.kernels.activation_pack": "coatstate.kernels.activation and coatstate.kernels.tensorwise",
    "coatstate.kernels.codec": "coatstate.kernels.group",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED_MODULES:
            raise ImportError(
                f"{fullname} moved in coatstate 0.2: import from {MOVED_MODULES[fullname]} (CHANGELOG.md)",
                name=fullname,
            )
        return None


def install_moved_module_finder() -> None:
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
