"""Which optimizers a checkpoint knows, and what their hyperparameters must be: one table that
the writer (checkpoint.encoding.check_writable) and the reader (checkpoint.validate) both check
against, so that no save succeeds into a file that a reader refuses.

Each kind is a torch reference and its compressed class: they load each other's checkpoints
(compressed on load, or decompressed). A header names its class; a state dict saved without one
is recognised by its param groups' keys. A class this table does not know (torch's Adafactor,
a user's own optimizer) keeps its hyperparameters as it gives them: its own load_state_dict
checks them, and coatstate checks only its own options (formats, group sizes) wherever they are.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from .optimizer_state import MOMENTS, MOMENTUM


@dataclasses.dataclass(frozen=True)
class OptimizerKind:
    """A torch reference optimizer and coatstate's compressed class of it."""

    reference: str
    """the reference's class name, as a header records it (Lion's: lion-pytorch's)"""
    compressed: str
    """coatstate's class"""
    moments: tuple[str, ...]
    """its moments' state names"""
    rules: Mapping[str, str]
    """hyperparameter -> rule name (_RULES)"""
    marks: frozenset[str]
    """param-group keys that together mark a state dict of this kind (saved without a class)"""


_TORCH_FLAGS = {"foreach": "flag", "fused": "flag", "capturable": "bool", "differentiable": "bool"}
"""torch's execution flags, where an optimizer has them"""
_ADAMW_RULES = {"lr": "lr", "eps": "number", "weight_decay": "number", "betas": "betas", "amsgrad": "bool",
                "maximize": "bool", "decoupled_weight_decay": "bool", **_TORCH_FLAGS}  # fmt: skip
KINDS = (
    OptimizerKind("AdamW", "CompressedAdamW", MOMENTS, _ADAMW_RULES, frozenset({"betas", "eps"})),
    OptimizerKind(
        "SGD",
        "CompressedSGD",
        (MOMENTUM,),
        {
            "lr": "lr",
            "momentum": "number",
            "dampening": "real",
            "weight_decay": "number_or_tensor",
            "nesterov": "bool",
            "maximize": "bool",
            **_TORCH_FLAGS,
        },
        frozenset({"momentum", "dampening"}),
    ),  # fmt: skip
    OptimizerKind(
        "Muon",
        "CompressedMuon",
        (MOMENTUM,),
        {
            "lr": "lr",
            "momentum": "number",
            "weight_decay": "number",
            "eps": "number",
            "nesterov": "bool",
            "ns_coefficients": "three_numbers",
            "ns_steps": "ns_steps",
            "adjust_lr_fn": "adjust_lr_fn",
            "fused": "flag",
        },
        frozenset({"ns_steps", "ns_coefficients"}),
    ),  # fmt: skip
    OptimizerKind(
        "Lion",
        "CompressedLion",
        ("exp_avg",),
        {"lr": "lr", "betas": "betas_closed", "weight_decay": "number", "maximize": "bool", "fused": "flag"},
        frozenset({"betas"}),
    ),  # fmt: skip
)


def kind_of(saved_class: str | None, group: Mapping[str, Any] | None = None) -> OptimizerKind | None:
    """The kind of a header's class, or for a state dict saved without one (None) the kind its
    param group's keys mark (AdamW's before Lion's, whose marks are a subset); None: unknown."""
    if saved_class is not None:
        return next((k for k in KINDS if saved_class in (k.reference, k.compressed)), None)
    keys = set(group or ())
    return next((k for k in KINDS if k.marks <= keys), None)


def same_family(a: str, b: str) -> bool:
    """Whether classes `a` and `b` load each other's checkpoints (a reference and its compressed
    class, or one class)."""
    kind = kind_of(a)
    return a == b or (kind is not None and b in (kind.reference, kind.compressed))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "number": (lambda v: _number(v) and v >= 0, "a number >= 0"),
    "real": (_number, "a finite number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "flag": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
    "betas": (
        lambda v: isinstance(v, (tuple, list)) and len(v) == 2 and all(_number(x) and 0 <= x < 1 for x in v),
        "two numbers in [0, 1)",
    ),
    "betas_closed": (
        lambda v: isinstance(v, (tuple, list)) and len(v) == 2 and all(_number(x) and 0 <= x <= 1 for x in v),
        "two numbers in [0, 1]",
    ),
    "three_numbers": (
        lambda v: isinstance(v, (tuple, list)) and len(v) == 3 and all(map(_number, v)),
        "three numbers",
    ),
    "ns_steps": (
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 100,
        "an int from 0 to 99",
    ),
    "adjust_lr_fn": (
        lambda v: v in (None, "original", "match_rms_adamw"),
        "null, 'original' or 'match_rms_adamw'",
    ),
}


def check_hyperparameters(kind: OptimizerKind | None, where: str, values: Mapping[str, Any], fail,
                          tensor_ok: Callable[[str, Any], bool]) -> None:  # fmt: skip
    """`fail(problem)` for a hyperparameter of `kind` that breaks its rule. `tensor_ok(name, v)`:
    whether `v` is a tensor the rule allows ("lr" and "number_or_tensor": a one-element float
    tensor), checked by the caller, who knows how the header describes tensors."""
    for name, rule in (kind.rules if kind is not None else {}).items():
        if name not in values:
            continue
        v = values[name]
        if rule in ("lr", "number_or_tensor"):
            if tensor_ok(name, v):
                continue
            rule = "number"
        check, what = _RULES[rule]
        if not check(v):
            fail(f"{where}.{name} must be {what}; got {v!r:.60}")
