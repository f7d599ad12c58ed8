"""The bookkeeping every compressed optimizer shares: param groups and their options, lazy state,
min_numel and which parameters stay float32, master weights, gradient release, GradScaler,
non-finite reports and state dicts. Each optimizer adds its update math and nothing else
(CompressedAdamW in optim/adamw.py; SGD, Lion and Muon in optim/sgd.py, lion.py, muon.py).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable
from typing import Any

import torch

from coatstate.distributed import (
    check_compressible,
    first_element,
    is_dtensor,
    local_state,
    local_tensor,
    wrap_state,
)
from coatstate.formats.master_weights import CORRECTION_DTYPES
from coatstate.formats.optimizer_state import (
    MASTER_CORRECTION,
    MOMENTS,
    expand_option,
    format_option,
    parse_format,
)
from coatstate.kernels.runtime import triton_usable
from coatstate.optim.external_writes import ExternalWrites
from coatstate.optim.moments import (
    global_shape,
    master_mode,
    moment_formats,
    optimizer_state_bytes,
    why_uncompressed,
)
from coatstate.optim.momentum_step import master_in, master_out
from coatstate.optim.options import (
    MOMENTS_WITH_OPTIONS,
    check_format_arguments,
    check_group,
    check_master_arguments,
    settle_group,
)
from coatstate.optim.release import GradientRelease

logger = logging.getLogger("coatstate")


def own_options(moment: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """coatstate's param-group options of a one-moment optimizer, checked, from its constructor's
    `arguments` (its locals(): the format options of `moment` are formats.optimizer_state's
    format_option and expand_option; a constructor without compress_1d gives False)."""
    a, fmt, expand = arguments, format_option(moment), expand_option(moment)
    check_format_arguments(a["group_size"], {fmt: a[fmt]})
    check_master_arguments(a["master_seed"], a["gradient_release"], a["max_grad_norm"])
    return {
        "compress": a["compress"],
        "group_size": a["group_size"],
        fmt: parse_format(a[fmt]).value,
        expand: a[expand],
        "min_numel": a["min_numel"],
        "compress_1d": a.get("compress_1d", False),
        "master_bits": a["master_bits"],
        "master_seed": a["master_seed"],
    }


class CompressedOptimizer(torch.optim.Optimizer):
    """Base of coatstate's optimizers; not used directly. A subclass names its moments (the state
    layout's names, coatstate.formats.optimizer_state), its reference and its checks, and
    implements `_update` (one parameter's step, pure torch) or overrides `_step_group`."""

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale/found_inf, as to fused AdamW
    MOMENTS: tuple[str, ...] = MOMENTS
    """state names of the moments, in the order their formats are decided"""
    OPTION_MOMENTS: tuple[str, ...] = MOMENTS_WITH_OPTIONS
    """the moments with a format option of their own"""
    REFERENCE = "torch.optim.AdamW"
    """the optimizer whose semantics this one has (named in errors)"""

    def __init__(
        self,
        params: Iterable,
        defaults: dict[str, Any],
        gradient_release: bool = False,
        max_grad_norm: float | None = None,
    ) -> None:
        super().__init__(params, defaults)
        self._reported: set[int] = set()
        self._fused_cache: dict = {}
        """fused launches with on-device non-finite counters (`.params`, `.nonfinite`)"""
        self._twin_nonfinite: dict = {}
        self._pending_nonfinite: list = []
        """(parameter, on-device count, step) of fused steps not read yet"""
        self._external_writes = ExternalWrites()
        self._index_params()
        # the note's stack level: the user's line that built the optimizer (through its __init__)
        self._release = GradientRelease(self, max_grad_norm, stacklevel=4) if gradient_release else None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            self._settle(len(self.param_groups) - 1, self.param_groups[-1])
        except (ValueError, TypeError):
            self.param_groups.pop()  # refused: the optimizer stays as it was
            raise
        self._index_params()
        if getattr(self, "_release", None) is not None:
            self._release.hook_new_groups()

    def _settle(self, gi: int, group: dict) -> None:
        """Resolve and check a new param group's options (ValueError/TypeError refuse it)."""
        settle_group(gi, group, self.OPTION_MOMENTS, self._check_group)

    def _check_group(self, gi: int, group: dict) -> None:
        check_group(gi, group)

    def _formats(self, group: dict, p: torch.Tensor) -> dict:
        """How each of p's moments is stored (None: float32), from p's global shape."""
        return moment_formats(group, global_shape(p), self.MOMENTS)

    # ---- reporting -------------------------------------------------------------------------

    def uncompressed_parameters(self) -> list[dict[str, Any]]:
        """Parameters whose moments are kept in float32, with the reason for each.

        Returns:
            `list[dict]`: per parameter its `name` (from `param_names`, else `group{g}.param{i}`),
            `shape`, `numel` and `reason`.
        """
        out = []
        for gi, group in enumerate(self.param_groups):
            names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                shape = global_shape(p)
                if moment_formats(group, shape, self.MOMENTS)[self.MOMENTS[0]] is None:
                    out.append(
                        {
                            "name": names[i] if names else f"group{gi}.param{i}",
                            "shape": tuple(shape),
                            "numel": math.prod(shape),
                            "reason": why_uncompressed(group, shape),
                        }
                    )
        return out

    def state_bytes(self) -> int:
        """Bytes of optimizer state held on this process (codes, scales, exponents, fp32 moments)."""
        return optimizer_state_bytes(self)

    def _report_once(self) -> None:
        kept = self.uncompressed_parameters()
        key = len(kept)
        if key in self._reported:
            return
        self._reported.add(key)
        if kept:
            n = sum(k["numel"] for k in kept)
            total = sum(math.prod(global_shape(p)) for g in self.param_groups for p in g["params"])
            reasons = sorted(
                {"fewer than min_numel elements" if "min_numel" in k["reason"] else k["reason"] for k in kept}
            )
            logger.info(
                "coatstate: %d of %d parameters (%.2f%% of elements) keep float32 moments (%s); "
                "see %s.uncompressed_parameters()",
                len(kept),
                sum(len(g["params"]) for g in self.param_groups),
                100.0 * n / max(total, 1),
                "; ".join(reasons),
                type(self).__name__,
            )

    def nonfinite_parameters(self) -> list[dict[str, Any]]:
        """Parameters whose moments have held NaN/Inf since the last call (then reset).

        Per parameter: `count` (moment values that were NaN/Inf, summed over the steps), `steps`
        (how many steps had any) and `last_step`. Counted on the device without synchronising;
        this call synchronises once. A NaN or Inf gradient that GradScaler did not catch shows up
        here instead of silently in a state; a NaN that stays in a moment is counted at every
        step it is there. The policy (docs/FORMAT.md, "Non-finite values"): a non-finite value is
        kept element by element, as torch's optimizers keep it, and its group's other values keep
        their precision.
        """
        self._read_pending_nonfinite()
        found = []
        for plan in self._fused_cache.values():
            counts = plan.nonfinite.tolist()
            plan.nonfinite.zero_()
            found += [(p, c) for p, c in zip(plan.params, counts, strict=True) if c[0]]
        found += list(self._twin_nonfinite.items())
        self._twin_nonfinite.clear()
        return [
            {"shape": tuple(p.shape), "count": count, "steps": steps, "last_step": last, "param": p}
            for p, (count, steps, last) in found
        ]

    def _record_nonfinite(self, p: torch.Tensor, bad: int | torch.Tensor, step: int) -> None:
        """Count a step's non-finite moment values; a fused kernel's count (a device tensor) is
        read later, at nonfinite_parameters() or once 1024 wait, not synchronised every step."""
        if isinstance(bad, torch.Tensor):
            self._pending_nonfinite.append((p, bad, step))
            if len(self._pending_nonfinite) >= 1024:
                self._read_pending_nonfinite()
            return
        if bad:
            count, steps, _ = self._twin_nonfinite.get(p, (0, 0, 0))
            self._twin_nonfinite[p] = (count + bad, steps + 1, step)

    def _read_pending_nonfinite(self) -> None:
        pending, self._pending_nonfinite = self._pending_nonfinite, []
        if pending:
            counts = torch.stack([bad.cpu() for _, bad, _ in pending]).tolist()
            for (p, _, step), count in zip(pending, counts, strict=True):
                self._record_nonfinite(p, int(count), step)

    # ---- parameters ------------------------------------------------------------------------

    def _index_params(self) -> None:
        # built here, never inside step(): torch.compile refuses attribute writes in a traced step
        self._param_index = {
            id(q): k for k, q in enumerate(q for g in self.param_groups for q in g["params"])
        }

    def _rounding_seed(self, group: dict, p: torch.Tensor) -> int:
        """The seed of p's stochastic roundings (master_bits=16's, a ue3m1_sqrt second moment's):
        the group's master_seed and p's place in the optimizer, so
        that every parameter rounds independently and a resumed run rounds as the original."""
        return (int(group.get("master_seed", 0)) * 1_000_003 + self._param_index.get(id(p), 0)) & 0xFFFFFFFF

    def _param_name(self, p: torch.Tensor) -> str:
        for gi, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    names = group.get("param_names")
                    return names[i] if names else f"group{gi}.param{i}"
        return "<not in this optimizer>"

    def _check_param(self, p: torch.Tensor) -> None:
        """Sparse and complex parameters have no compressed update: a TypeError with the fix."""
        name = type(self).__name__
        if p.grad.is_sparse or p.is_sparse:
            raise TypeError(f"{name} does not support sparse gradients; use {self.REFERENCE}")
        if torch.is_complex(p):
            raise TypeError(
                f"{name} does not support complex parameters; view them as real "
                f"(torch.view_as_real) or use {self.REFERENCE}"
            )

    @staticmethod
    def _use_fused(group: dict, p: torch.Tensor) -> bool:
        """fused=None: the Triton step on CUDA. fused=True: required (CUDA, or Triton's CPU
        interpreter when TRITON_INTERPRET=1, for tests). fused=False: the pure-torch step."""
        if group.get("fused") is False:
            return False
        local = local_tensor(p)
        required = bool(group.get("fused"))
        if not triton_usable(local.device, interpreter=required):
            if required:
                raise ValueError(
                    f"fused=True needs CUDA tensors with Triton (got a parameter on {local.device}); "
                    "pass fused=None to fall back to the pure-torch step"
                )
            return False
        if not local.is_contiguous() or local.data_ptr() % 16:
            if required:
                raise ValueError("fused=True needs contiguous, 16-byte aligned parameters; pass fused=None")
            return False  # a strided or oddly offset view: the pure-torch step handles it
        return True

    def _init_state(self, p: torch.Tensor, group: dict, on_device: bool) -> dict:
        """p's state, created on first use: its step and master correction. Moments are created
        by the update that first needs them (torch's SGD creates its buffer from the first
        gradient); a DTensor parameter gets DTensor states (coatstate.distributed)."""
        state = self.state[p]
        if not state:
            local = local_tensor(p)
            if is_dtensor(p) and self._formats(group, p)[self.MOMENTS[0]] is not None:
                check_compressible(p, self._param_name(p))
            state["step"] = torch.tensor(
                0.0, dtype=torch.float32, device=local.device if on_device else "cpu"
            )
            mode = master_mode(group, p)
            if mode in CORRECTION_DTYPES:  # the weight is exactly its master
                state[MASTER_CORRECTION] = torch.zeros_like(local, dtype=CORRECTION_DTYPES[mode])
        return state

    # ---- the step --------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """One optimization step over every parameter with a gradient.

        Args:
            closure (`Callable`, *optional*): re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if self._release is not None:
            if grad_scale is not None or found_inf is not None:
                raise RuntimeError(
                    "coatstate: GradScaler does not work with gradient_release=True (each parameter "
                    "steps during backward, before the scaler can unscale or skip): train in "
                    "bfloat16 autocast, which needs no scaler, or use gradient_release=False"
                )
            self._release.end_iteration()  # gradients set by hand (no hook fired) step below
        for group in self.param_groups:
            self._step_group(group, grad_scale, found_inf)
        return loss

    def _step_group(self, group: dict, grad_scale, found_inf) -> None:
        """One param group's step: each parameter with a gradient through `_update`."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        self._report_once()
        for p in params:
            self._check_param(p)
        self._step_params(group, params, grad_scale, found_inf)

    def _step_released(self, group: dict, p: torch.Tensor) -> None:
        """One parameter's step from its gradient-release hook."""
        self._step_params(group, [p], None, None)

    # under torch.compile: run eagerly (one graph break per step), as CompressedAdamW's step
    @torch.compiler.disable
    def _step_params(self, group: dict, params: list, grad_scale, found_inf) -> None:
        masters = [p for p in params if master_mode(group, p) in CORRECTION_DTYPES]
        self._external_writes.drop_stale(masters, self.state, self._param_name)
        if found_inf is None or not bool(found_inf.item()):  # GradScaler found Inf/NaN: skip, as torch
            inv_scale = None
            if grad_scale is not None:
                inv_scale = grad_scale.double().reciprocal().float()  # exactly GradScaler.unscale_'s
            for p in params:
                fused = self._use_fused(group, p)
                state = self._init_state(p, group, on_device=fused)
                state["step"] += 1
                g = local_tensor(p.grad)
                if inv_scale is not None:
                    g = g * inv_scale.to(g.device)
                step = int(state["step"].item())
                local = local_state(state)
                bad = self._update(local_tensor(p), g, local, group, p, step, fused)
                self._record_nonfinite(p, bad, step)
                for key, value in local.items():  # a moment the update created
                    state.setdefault(key, value)
                if is_dtensor(p):
                    wrap_state(state, p)
        self._external_writes.record(masters)

    def _update(
        self, param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, p: torch.Tensor,
        step: int, fused: bool,
    ) -> int:  # fmt: skip
        """One parameter's update (its local tensor, its unscaled gradient, its local state; p the
        parameter itself, for its global shape and master mode). Returns how many moment values
        came out NaN/Inf."""
        raise NotImplementedError

    HYPERPARAMETERS: tuple[str, ...] = ()
    """the param-group keys a one-moment optimizer's step function takes as keywords"""

    def _apply(self, twin, kernel, param, grad, state, group, p, step, fused) -> int:
        """One parameter's update through `twin` (coatstate.optim.momentum_step: float32 math on the
        master weight) or, on the fused path, `kernel` (float32 parameters and gradients without a
        master: the other cases take the twin), with the parameter's one moment format and the
        group's HYPERPARAMETERS."""
        hyper = {k: group[k] for k in self.HYPERPARAMETERS}
        fmt = self._formats(group, p)[self.MOMENTS[0]]
        bits = master_mode(group, p)
        if fused and kernel is not None and bits is None and param.dtype == grad.dtype == torch.float32:
            from coatstate.kernels.momentum_fused import launchable

            if launchable(fmt):
                return kernel(param, grad, state, fmt, **hyper)
        x = master_in(param, state, bits)
        bad = twin(x, grad if grad.dtype == torch.float32 else grad.float(), state, fmt, **hyper)
        master_out(param, x, state, bits, self._rounding_seed(group, p), step, first_element(p))
        return bad

    # ---- state dicts -----------------------------------------------------------------------

    LOAD_DEFAULTS: dict[str, Any] = {}
    """what the reference's __setstate__ fills into a loaded param group that lacks the key"""

    def _loaded_state(self, state_dict: dict[str, Any]) -> tuple[list, dict]:
        """(param groups, state) to install for `state_dict`, every value checked and converted
        (ValueError before anything changes); a state of the reference loads too."""
        from coatstate.optim.state_dict import convert_param_state, loaded_state

        reference = self.REFERENCE.removeprefix("torch.optim.")
        convert = functools.partial(
            convert_param_state, moments=self.MOMENTS, required=(), reference=reference
        )
        return loaded_state(self.param_groups, state_dict, convert, self.LOAD_DEFAULTS, self._check_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this optimizer's state dict or its reference's (compressing it as configured).

        As torch.optim.Optimizer.load_state_dict: the load_state_dict pre-hooks run first (one
        may return a new dict), the post-hooks last; keys an older torch did not write get
        torch's defaults; a loaded group without param_names keeps this optimizer's.
        Hyperparameters come from the loaded dict; coatstate's format keys that it lacks (the
        reference's dict) keep this optimizer's values. Moments are converted to this optimizer's
        format for each parameter; states are never cast to the parameter's dtype. Everything is
        checked and converted before anything changes: a dict that is refused (ValueError)
        leaves the optimizer as it was.
        """
        state_dict = dict(state_dict) if isinstance(state_dict, dict) else state_dict
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        # everything checked and converted first: a refused dict changes nothing
        new_groups, new_state = self._loaded_state(state_dict)
        for mine, merged in zip(self.param_groups, new_groups, strict=True):  # in place: references hold
            mine.clear()
            mine.update(merged)
        self.state.clear()
        self.state.update(new_state)
        self._forget_launches()
        self._twin_nonfinite.clear()
        self._pending_nonfinite.clear()
        self._external_writes.forget()
        self._index_params()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _forget_launches(self) -> None:
        """Drop what was prepared for the states a load replaces."""
        self._fused_cache.clear()
