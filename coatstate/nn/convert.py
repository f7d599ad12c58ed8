"""convert_to_fp8 (swap nn.Linear for FP8Linear in a model) and fp8_fallbacks (what did not run FP8)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn

from coatstate.distributed import is_dtensor
from coatstate.nn.config import FP8LinearConfig
from coatstate.nn.module import FP8Linear

logger = logging.getLogger("coatstate")

DEFAULT_MIN_FEATURES = 1536
"""convert_to_fp8 keeps narrower layers: the width at which FP8Linear first ran faster than
nn.Linear on the GPU (benchmarks/experiments/fp8_width.py; docs/performance.md has the sweep)"""


def convert_to_fp8(
    model: nn.Module,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    config: FP8LinearConfig | None = None,
    min_features: int | None = DEFAULT_MIN_FEATURES,
) -> nn.Module:
    """Turn the nn.Linear modules of `model` (those `filter_fn(module, name)` accepts) into FP8Linear.

    In place. Each module keeps its identity, parameters (tied weights stay tied, an optimizer
    built before keeps working), hooks and state-dict keys, so a checkpoint of the converted model
    loads into the original and back. Only modules of type exactly nn.Linear are converted
    (subclasses such as MultiheadAttention's out_proj never run their own forward). Layers whose
    shape torch._scaled_mm cannot take are converted but run in high precision; one log line
    lists them, and so does `coatstate.nn.fp8_fallbacks(model)`.

    Args:
        model (`nn.Module`): the model, converted in place; before FSDP2's fully_shard.
        filter_fn (`Callable[[nn.Module, str], bool]`, *optional*): which linear layers (module,
            qualified name) to convert; all by default. Keeping the LM head is usual.
        config (`FP8LinearConfig`, *optional*): how the converted layers compute.
        min_features (`int`, *optional*, defaults to 1536): keep layers with fewer in or out
            features than this as nn.Linear (one log line lists them): FP8's casts cost more than
            its faster GEMM on narrow layers (docs/performance.md has the measured sweep). None
            converts every width, e.g. for FP8's memory on a narrow model.

    Returns:
        `nn.Module`: `model`.

    Raises:
        TypeError: `model` is not an nn.Module, or `filter_fn` is not callable.
        ValueError: `min_features` is not a positive int or None.
        ValueError: the parameters are already DTensors (FSDP2 or tensor parallel applied first).

    Example:
        >>> coatstate.convert_to_fp8(model, filter_fn=lambda m, name: name != "lm_head")
        >>> coatstate.nn.fp8_fallbacks(model)  # {name: why} of layers left in high precision
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module; got {type(model).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be callable as filter_fn(module, name) -> bool; got {filter_fn!r}")
    if min_features is not None and (
        isinstance(min_features, bool) or not isinstance(min_features, int) or min_features < 1
    ):
        raise ValueError(f"min_features must be a positive int (features) or None; got {min_features!r}")
    sharded = [name for name, p in model.named_parameters() if is_dtensor(p)]
    if sharded:  # FSDP2 wraps modules in subclasses a type check would skip: refuse, never skip silently
        raise ValueError(
            f"{len(sharded)} parameters (e.g. {sharded[0]!r}) are already DTensors: call convert_to_fp8 "
            "BEFORE fully_shard (FSDP2) or parallelize_module"
        )
    converted, narrow = [], []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or (filter_fn is not None and not filter_fn(module, name)):
            continue
        if min_features is not None and min(module.in_features, module.out_features) < min_features:
            narrow.append(f"{name} ({module.in_features}x{module.out_features})")
            continue
        module.__class__ = FP8Linear
        module._setup_fp8(config, log=False)
        converted.append(name)
    if narrow:
        logger.info(
            "convert_to_fp8: kept %d linear layers narrower than min_features=%d in high precision "
            "(FP8 is slower there; min_features=None converts them): %s",
            len(narrow),
            min_features,
            "; ".join(narrow),
        )
    fallbacks = fp8_fallbacks(model)
    if fallbacks:
        logger.warning(
            "convert_to_fp8: %d of %d converted linear layers run in high precision: %s",
            len(fallbacks),
            len(converted),
            "; ".join(f"{n} ({r})" for n, r in fallbacks.items()),
        )
    return model


def fp8_fallbacks(model: nn.Module) -> dict[str, str]:
    """{module name: reason} for every FP8Linear in `model` that runs in high precision."""
    return {
        name: module.fallback_reason
        for name, module in model.named_modules()
        if isinstance(module, FP8Linear) and module.fallback_reason is not None
    }
