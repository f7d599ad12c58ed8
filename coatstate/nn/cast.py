"""cast_model: a model's parameters in 16 bits for master_bits training, norms kept in float32."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def _is_norm(module: nn.Module, name: str) -> bool:
    rms = getattr(nn, "RMSNorm", ())
    return isinstance(module, (*_NORMS, rms) if rms else _NORMS) or "norm" in type(module).__name__.lower()


def cast_model(
    model: nn.Module,
    dtype: torch.dtype = torch.bfloat16,
    keep: Callable[[nn.Module, str], bool] | None = _is_norm,
) -> nn.Module:
    """Cast `model`'s floating-point parameters and buffers to `dtype`, in place, except in the
    modules `keep(module, name)` accepts (by default norms), which stay float32 and get hooks that
    run them in float32 and hand their outputs back in `dtype`.

    Pair it with `CompressedAdamW(model.parameters(), master_bits=24)` (or 32, 16): the 16-bit
    parameters step on a master the optimizer holds, the float32 ones are their own master.

    Args:
        model (`nn.Module`): the model, converted in place.
        dtype (`torch.dtype`, defaults to `torch.bfloat16`): the 16-bit type.
        keep (`Callable[[nn.Module, str], bool]` or `None`): modules kept in float32; `None` keeps none.

    Returns:
        `nn.Module`: `model`.

    Raises:
        ValueError: `dtype` is not torch.bfloat16 or torch.float16.

    Example:
        >>> model = coatstate.cast_model(model)            # bf16 weights, float32 norms
        >>> opt = coatstate.CompressedAdamW(model.parameters(), master_bits=24)
    """
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"cast_model casts to torch.bfloat16 or torch.float16; got {dtype}")
    kept = {id(m) for name, m in model.named_modules() if keep is not None and keep(m, name)}
    for module in model.modules():
        own = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
        if id(module) in kept or not own:
            continue
        for t in own.values():
            if t.is_floating_point():
                t.data = t.data.to(dtype)
    for module in model.modules():
        if id(module) in kept:
            module.float()
            module.register_forward_pre_hook(_to_float32)
            module.register_forward_hook(lambda m, args, out, d=dtype: _cast(out, d))
    return model


def _cast(value, dtype: torch.dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, tuple):
        return tuple(_cast(v, dtype) for v in value)
    return value


def _to_float32(module: nn.Module, args: tuple) -> tuple:
    return tuple(_cast(a, torch.float32) for a in args)
