"""CompressedSGD: torch.optim.SGD with its momentum buffer in the library's group formats."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from coatstate.formats.defaults import MOMENTUM_DEFAULTS
from coatstate.formats.optimizer_state import MOMENTUM
from coatstate.optim.base import CompressedOptimizer, own_options
from coatstate.optim.momentum_options import check_sgd_arguments, check_sgd_group
from coatstate.optim.momentum_step import sgd_step

_D = MOMENTUM_DEFAULTS
SGD_GROUP_DEFAULTS = {
    "nesterov": False,
    "maximize": False,
    "foreach": None,
    "differentiable": False,
    "fused": None,
}
"""what torch.optim.SGD.__setstate__ fills into a loaded param group that lacks the key"""


class CompressedSGD(CompressedOptimizer):
    """SGD with momentum, its momentum buffer in FP8 (COAT's group format) or 4 bits.

    A `torch.optim.Optimizer` with torch.optim.SGD's semantics, defaults (momentum=0: no buffer,
    nothing to compress) and hyperparameter checks; with `compress=False` it steps exactly as
    torch.optim.SGD(foreach=False) on float32 parameters. The buffer is created from the first
    gradient, as torch does. Which parameters keep a float32 buffer is decided from each
    parameter's global shape (`uncompressed_parameters()` lists them); 16-bit parameters step on
    a float32 master (`master_bits`), as in CompressedAdamW.

    Args:
        params (`Iterable`): parameters or param groups, as for torch.optim.SGD; a group may
            override any option below.
        lr, momentum, dampening, weight_decay, nesterov, maximize, foreach: as torch.optim.SGD.
        fused (`bool | None`): `None` runs the fused Triton momentum step on CUDA and the
            pure-torch step elsewhere; `True` requires Triton; `False` forces pure torch.
        compress (`bool`): store the momentum buffer in a group format.
        group_size (`int`): elements per quantization group along a row.
        momentum_format (`str`): `"e4m3"` or `"e5m2"` (FP8), or `"e2m1"` (4-bit).
        momentum_expand (`bool | str`): COAT's dynamic range expansion; `"auto"`: on for FP8.
        min_numel, compress_1d, master_bits, master_seed, gradient_release, max_grad_norm: as
            CompressedAdamW's.

    Returns:
        The optimizer. `step(closure=None)` returns the closure's loss (or None).

    Raises:
        ValueError: torch.optim.SGD's refusals (negative lr, momentum or weight_decay; nesterov
            without momentum or with dampening), a bad format option, `differentiable=True`.
        TypeError: sparse gradients or complex parameters (at the first step).

    Example:

    ```python
    import torch
    from coatstate import CompressedSGD

    model = torch.nn.Linear(256, 256)
    opt = CompressedSGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    model(torch.randn(8, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    ```
    """

    MOMENTS = (MOMENTUM,)
    OPTION_MOMENTS = (MOMENTUM,)
    LOAD_DEFAULTS = SGD_GROUP_DEFAULTS
    HYPERPARAMETERS = ("lr", "momentum", "dampening", "nesterov", "weight_decay", "maximize")
    REFERENCE = "torch.optim.SGD"

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        compress: bool = _D["compress"],
        group_size: int = _D["group_size"],
        momentum_format: str = _D["momentum_format"],
        momentum_expand: bool | str = _D["momentum_expand"],
        min_numel: int = _D["min_numel"],
        compress_1d: bool = _D["compress_1d"],
        master_bits: int | str | None = _D["master_bits"],
        master_seed: int = _D["master_seed"],
        gradient_release: bool = False,
        max_grad_norm: float | None = None,
    ) -> None:
        check_sgd_arguments(lr, momentum, dampening, weight_decay, nesterov, differentiable)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            foreach=foreach,
            differentiable=False,
            fused=fused,
            **own_options(MOMENTUM, locals()),
        )
        super().__init__(params, defaults, gradient_release, max_grad_norm)

    def _check_group(self, gi: int, group: dict) -> None:
        check_sgd_group(gi, group)

    def _update(self, param, grad, state, group, p, step, fused) -> int:
        kernel = None
        if fused and group["momentum"] != 0:
            from coatstate.kernels.momentum_fused import sgd_fused

            kernel = sgd_fused
        return self._apply(sgd_step, kernel, param, grad, state, group, p, step, fused)
