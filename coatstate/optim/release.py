"""Gradient release: each parameter steps in its post-accumulate-grad hook during backward and its
gradient is freed at once, so the gradients of the whole model never exist together.

What cannot be exact is refused rather than approximated silently: a second backward before
opt.step() would be gradient accumulation (the first micro-batch has already stepped), and a
global-norm clip needs every gradient before the first step. `max_grad_norm` offers the nearest
thing: each gradient is scaled by min(1, max_grad_norm / norm), with the norm of the PREVIOUS
iteration's gradients (no clipping on the first), which is documented as such.

torch.nn.utils.clip_grad_norm_ after backward finds every gradient already freed: it returns
tensor(0.) and clips nothing. No hook sees that call, so the first optimizer built with release
and without max_grad_norm says so once per process, as a note: most users never clip, and a
warning on every construction would be noise to them.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

_ACCUMULATION = (
    "coatstate: gradient_release=True stepped this parameter during an earlier backward, and a "
    "second backward reached it before opt.step(): that is gradient accumulation, which release "
    "cannot do exactly (the first micro-batch has already been applied). Call opt.step() after "
    "every backward, or use gradient_release=False to accumulate."
)


_NO_CLIP = (
    "coatstate note (shown once): gradient_release=True frees each gradient during backward. If you "
    "clip gradients, pass CompressedAdamW(..., max_grad_norm=...) (it clips by the previous step's "
    "global norm): torch.nn.utils.clip_grad_norm_ called after backward would see no gradients and "
    "clip nothing. If you do not clip, nothing to do."
)
_noted = False
"""whether this process has shown _NO_CLIP"""


class GradientRelease:
    """The hooks and per-iteration bookkeeping of CompressedAdamW(gradient_release=True)."""

    def __init__(self, optimizer: Any, max_grad_norm: float | None) -> None:
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be a positive float; got {max_grad_norm!r}")
        global _noted
        if max_grad_norm is None and not _noted:
            _noted = True
            warnings.warn(_NO_CLIP, UserWarning, stacklevel=3)  # at the user's CompressedAdamW(...)
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.stepped: set[int] = set()
        """ids of the parameters stepped since the last opt.step()"""
        self.norm_sq: torch.Tensor | None = None
        """this iteration's sum of squared gradient norms (on the device, never synchronised)"""
        self.previous_norm: torch.Tensor | None = None
        self.handles: list = []
        self.groups: dict[int, dict] = {}
        self.hook_new_groups()

    def hook_new_groups(self) -> None:
        """Register the hook on parameters not seen yet (the constructor's, add_param_group's)."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in self.groups:
                    self.groups[id(p)] = group
                    if p.requires_grad:
                        self.handles.append(p.register_post_accumulate_grad_hook(self._hook))

    def _hook(self, p: torch.Tensor) -> None:
        if id(p) in self.stepped:
            raise RuntimeError(_ACCUMULATION)
        if p.grad is None:
            return
        group = self.groups[id(p)]
        if self.max_grad_norm is not None:
            sq = p.grad.detach().float().square().sum()
            self.norm_sq = sq if self.norm_sq is None else self.norm_sq + sq
            if self.previous_norm is not None:
                factor = (self.max_grad_norm / (self.previous_norm + 1e-6)).clamp(max=1.0)
                p.grad.mul_(factor.to(p.grad.dtype))
        with torch.no_grad():
            self.optimizer._step_released(group, p)
        p.grad = None
        self.stepped.add(id(p))

    def end_iteration(self) -> None:
        """opt.step(): the iteration's parameters have all stepped; the next backward starts anew."""
        if self.norm_sq is not None:
            self.previous_norm = self.norm_sq.sqrt()
            self.norm_sq = None
        self.stepped.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
