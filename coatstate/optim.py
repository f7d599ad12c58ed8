"""CompressedAdamW: torch.optim.AdamW with its moments in the FP8 group format (COAT).

Bookkeeping lives here (param groups, lazy state, GradScaler, state dicts, reporting); the update
math lives in kernels.adamw_twin (pure torch, the CPU path) and kernels.adamw_fused with
kernels.adamw_launch (Triton, CUDA).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable
from typing import Any

import torch

from coatstate.distributed import (
    check_compressible,
    is_dtensor,
    local_chunk,
    local_state,
    local_tensor,
    wrap_state,
)
from coatstate.formats import FP8Format
from coatstate.kernels.adamw_twin import (
    MOMENTS,
    MomentFormat,
    adamw_step_reference,
    init_moment,
    is_compressed,
    read_moment,
    write_moment,
)

logger = logging.getLogger("coatstate")

FORMAT_DEFAULTS: dict[str, Any] = {
    "compress": True,
    "group_size": 128,
    "exp_avg_format": "e4m3",
    "exp_avg_sq_format": "e4m3",
    "exp_avg_expand": True,
    "exp_avg_sq_expand": True,
    "min_numel": 4096,
    "compress_1d": False,
}
"""coatstate's own param-group keys (beside torch.optim.AdamW's) and their defaults."""


def global_shape(p: torch.Tensor) -> torch.Size:
    """The full shape of a parameter: a DTensor's global shape, never its local shard's."""
    return p.shape  # DTensor.shape is the global shape


def moment_formats(group: dict, shape: torch.Size) -> dict[str, MomentFormat | None]:
    """How each moment of a parameter of global `shape` is stored (None: float32)."""
    numel = math.prod(shape)
    compress = (
        group.get("compress", True)
        and numel >= group.get("min_numel", FORMAT_DEFAULTS["min_numel"])
        and (len(shape) >= 2 or group.get("compress_1d", False))
    )
    if not compress:
        return dict.fromkeys(MOMENTS)
    g = group.get("group_size", 128)
    first = MomentFormat(
        FP8Format.parse(group.get("exp_avg_format", "e4m3")), group.get("exp_avg_expand", True), g
    )
    second = MomentFormat(
        FP8Format.parse(group.get("exp_avg_sq_format", "e4m3")), group.get("exp_avg_sq_expand", True), g
    )
    return {"exp_avg": first, "exp_avg_sq": second, "max_exp_avg_sq": second}


def _why_uncompressed(group: dict, shape: torch.Size) -> str:
    if not group.get("compress", True):
        return "compression is off for its param group"
    if len(shape) < 2 and not group.get("compress_1d", False):
        return "1-D parameter (norm weight or bias)"
    return f"{math.prod(shape)} elements < min_numel={group.get('min_numel')}"


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of any optimizer's state tensors held on this process, step counters left out: a
    DTensor counts its local shard, a tensor subclass (torchao's low-bit states) what it stores."""

    def nbytes(t: torch.Tensor) -> int:
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()  # a DTensor also names its device_mesh here
            inner = (getattr(t, n) for n in names)
            return sum(nbytes(x) for x in inner if isinstance(x, torch.Tensor))
        return t.numel() * t.element_size()

    return sum(
        nbytes(t)
        for state in optimizer.state.values()
        for key, t in state.items()
        if key != "step" and isinstance(t, torch.Tensor)
    )


def _options(group: dict) -> tuple:
    """The param-group options a prepared launch depends on (a change, e.g. amsgrad switched on,
    creates states and launches anew)."""
    return (group["amsgrad"], *(group.get(k, v) for k, v in FORMAT_DEFAULTS.items()))


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


@dataclasses.dataclass
class _Prepared:
    """A param group's parameters with gradients, sorted into the fused and pure-torch paths."""

    params: list
    fused: list
    twin: list
    launches: list
    options: tuple
    """the group's options that shape states and launches (amsgrad, formats) when prepared"""


@dataclasses.dataclass
class _LaunchRecord:
    """The parameters of one fused launch and its on-device non-finite counters."""

    params: list
    launch: Any

    @property
    def nonfinite(self) -> torch.Tensor:
        return self.launch.nonfinite


class CompressedAdamW(torch.optim.Optimizer):
    """AdamW with FP8 (COAT) first and second moments.

    Takes every argument of torch.optim.AdamW with the same defaults and meaning, plus:
      compress: store moments in FP8 (False: exactly torch.optim.AdamW).
      group_size: elements per quantization group along a row (128).
      exp_avg_format / exp_avg_sq_format: "e4m3" or "e5m2".
      exp_avg_expand / exp_avg_sq_expand: dynamic range expansion per moment.
      min_numel: parameters with fewer elements keep float32 moments (4096).
      compress_1d: also compress 1-D parameters (off: norm weights and biases stay float32).
    The decision uses each parameter's global shape, so sharding never changes precision.
    `fused=None/True` runs the Triton step on CUDA; `fused=False` forces the pure-torch step.
    """

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale/found_inf, as to fused AdamW

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        compress: bool = True,
        group_size: int = 128,
        exp_avg_format: str = "e4m3",
        exp_avg_sq_format: str = "e4m3",
        exp_avg_expand: bool = True,
        exp_avg_sq_expand: bool = True,
        min_numel: int = 4096,
        compress_1d: bool = False,
    ) -> None:
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise ValueError(f"Tensor lr must be 1-element; got shape {tuple(lr.shape)}")
        elif not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, b in enumerate(betas):
            if isinstance(b, torch.Tensor):
                raise ValueError("tensor betas are not supported by CompressedAdamW; pass floats")
            if not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if capturable or differentiable:
            raise ValueError(
                "CompressedAdamW does not support capturable=True or differentiable=True: its "
                "states are requantized in place each step; use torch.optim.AdamW for those modes"
            )
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int; got {group_size!r}")
        for name, value in (("exp_avg_format", exp_avg_format), ("exp_avg_sq_format", exp_avg_sq_format)):
            try:
                FP8Format.parse(value)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=False,
            differentiable=False,
            fused=fused,
            decoupled_weight_decay=True,
            compress=compress,
            group_size=group_size,
            exp_avg_format=FP8Format.parse(exp_avg_format).value,
            exp_avg_sq_format=FP8Format.parse(exp_avg_sq_format).value,
            exp_avg_expand=exp_avg_expand,
            exp_avg_sq_expand=exp_avg_sq_expand,
            min_numel=min_numel,
            compress_1d=compress_1d,
        )
        super().__init__(params, defaults)
        self._reported: set[int] = set()
        self._fused_cache: dict = {}
        self._prepared: dict[int, _Prepared] = {}
        """per param group (by id): its parameters sorted into paths, with the fused launches"""
        self._twin_nonfinite: dict = {}

    # ---- reporting -------------------------------------------------------------------------

    def uncompressed_parameters(self) -> list[dict[str, Any]]:
        """Parameters whose moments are kept in float32, with the reason for each."""
        out = []
        for gi, group in enumerate(self.param_groups):
            names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                shape = global_shape(p)
                if moment_formats(group, shape)["exp_avg"] is None:
                    out.append(
                        {
                            "name": names[i] if names else f"group{gi}.param{i}",
                            "shape": tuple(shape),
                            "numel": math.prod(shape),
                            "reason": _why_uncompressed(group, shape),
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
                "see CompressedAdamW.uncompressed_parameters()",
                len(kept),
                sum(len(g["params"]) for g in self.param_groups),
                100.0 * n / max(total, 1),
                "; ".join(reasons),
            )

    # ---- the step --------------------------------------------------------------------------

    def _init_state(self, p: torch.Tensor, group: dict, on_device: bool) -> dict:
        """p's state, created on first use; a DTensor parameter gets DTensor moments (its local
        rows only: see coatstate.distributed)."""
        state = self.state[p]
        formats = moment_formats(group, global_shape(p))
        if not state:
            local = local_tensor(p)
            if is_dtensor(p) and formats["exp_avg"] is not None:
                check_compressible(p, self._param_name(p))
            state["step"] = torch.tensor(
                0.0, dtype=torch.float32, device=local.device if on_device else "cpu"
            )
            names = MOMENTS if group["amsgrad"] else MOMENTS[:2]
            for name in names:
                init_moment(state, name, local, formats[name])
        elif group["amsgrad"] and "max_exp_avg_sq" not in state and "max_exp_avg_sq_codes" not in state:
            init_moment(state, "max_exp_avg_sq", local_tensor(p), formats["max_exp_avg_sq"])
        if is_dtensor(p):
            wrap_state(state, p)
        return state

    def _param_name(self, p: torch.Tensor) -> str:
        for gi, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    names = group.get("param_names")
                    return names[i] if names else f"group{gi}.param{i}"
        return "<not in this optimizer>"

    @staticmethod
    def _use_fused(group: dict, p: torch.Tensor) -> bool:
        """fused=None: the Triton step on CUDA. fused=True: required (CUDA, or Triton's CPU
        interpreter when TRITON_INTERPRET=1, for tests). fused=False: the pure-torch step."""
        if group.get("fused") is False:
            return False
        from coatstate.kernels import adamw_launch

        local = local_tensor(p)
        device = local.device
        if not local.is_contiguous() or local.data_ptr() % 16:
            if group.get("fused"):
                raise ValueError("fused=True needs contiguous, 16-byte aligned parameters; pass fused=None")
            return False  # a strided or oddly offset view: the pure-torch step handles it
        if group.get("fused") is None:
            return device.type == "cuda" and adamw_launch.available()
        if not adamw_launch.usable(device):
            raise ValueError(
                f"fused=True needs CUDA tensors with Triton (got a parameter on {device}); "
                "pass fused=None to fall back to the pure-torch step"
            )
        return True

    def nonfinite_parameters(self) -> list[dict[str, Any]]:
        """Parameters whose moments have held NaN/Inf since the last call (then reset).

        Counted on the device without synchronising; this call synchronises once. A NaN or Inf
        gradient that GradScaler did not catch shows up here instead of silently in a state.
        """
        out = []
        for plan in self._fused_cache.values():
            counts = plan.nonfinite.tolist()
            plan.nonfinite.zero_()
            pairs = zip(plan.params, counts, strict=True)
            out += [{"shape": tuple(p.shape), "count": c, "param": p} for p, c in pairs if c]
        for p, count in self._twin_nonfinite.items():
            if count:
                out.append({"shape": tuple(p.shape), "count": count, "param": p})
        self._twin_nonfinite.clear()
        return out

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            prepared = self._prepared.get(id(group))
            with_grad = [p for p in group["params"] if p.grad is not None]
            if (
                prepared is None
                or not _same(prepared.params, with_grad)
                or prepared.options != _options(group)
            ):
                prepared = self._prepare(group, with_grad)
            grads = [local_tensor(p.grad) for p in prepared.fused]
            if prepared.fused:
                from coatstate.kernels import adamw_launch

                if any(g.is_sparse for g in grads) or not adamw_launch.run(
                    prepared.launches, group, grads, grad_scale, found_inf
                ):
                    prepared = self._prepare(group, with_grad)  # a gradient or parameter changed
                    grads = [local_tensor(p.grad) for p in prepared.fused]
                    if not adamw_launch.run(prepared.launches, group, grads, grad_scale, found_inf):
                        raise RuntimeError("coatstate: the fused step could not be prepared (please report)")
            if prepared.twin:
                self._twin_step(group, prepared.twin, grad_scale, found_inf)
        return loss

    def _prepare(self, group: dict, with_grad: list) -> _Prepared:
        """Sort a group's parameters into the fused and pure-torch paths, create their states and
        build the fused launches; done when the set of parameters with gradients changes (the first
        step, a frozen layer, a load), not every step: per-parameter Python is the step's host cost."""
        self._report_once()
        fused, twin = [], []
        for p in with_grad:
            if p.grad.is_sparse or p.is_sparse:
                raise TypeError(
                    "CompressedAdamW does not support sparse gradients; use torch.optim.SparseAdam"
                )
            if torch.is_complex(p):
                raise TypeError(
                    "CompressedAdamW does not support complex parameters; view them as real "
                    "(torch.view_as_real) or use torch.optim.AdamW"
                )
            (fused if self._use_fused(group, p) else twin).append(p)
        launches = []
        if fused:
            from coatstate.kernels import adamw_launch

            launches = adamw_launch.prepare(
                group,
                [local_tensor(p) for p in fused],
                [local_tensor(p.grad) for p in fused],
                [local_state(self._init_state(p, group, on_device=True)) for p in fused],
                [moment_formats(group, global_shape(p)) for p in fused],
            )
            for key in [k for k in self._fused_cache if k[0] == id(group)]:
                del self._fused_cache[key]  # counters of the launches being replaced
            for launch in launches:  # nonfinite_parameters reads the counters per launch
                self._fused_cache[(id(group), id(launch))] = _LaunchRecord(
                    [fused[i] for i in launch.index], launch
                )
        prepared = self._prepared[id(group)] = _Prepared(
            list(with_grad), fused, twin, launches, _options(group)
        )
        return prepared

    def _twin_step(self, group, params, grad_scale, found_inf) -> None:
        if found_inf is not None and bool(found_inf.item()):
            return  # GradScaler found Inf/NaN in the gradients: skip, as torch does
        inv_scale = None
        if grad_scale is not None:
            inv_scale = grad_scale.double().reciprocal().float()  # exactly GradScaler.unscale_'s
        beta1, beta2 = group["betas"]
        lr = group["lr"].item() if isinstance(group["lr"], torch.Tensor) else group["lr"]
        for p in params:
            state = self._init_state(p, group, on_device=False)
            state["step"] += 1
            g = local_tensor(p.grad)
            bad = adamw_step_reference(
                local_tensor(p),
                g,
                local_state(state),
                moment_formats(group, global_shape(p)),
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                maximize=group["maximize"],
                amsgrad=group["amsgrad"],
                step=state["step"].item(),
                inv_grad_scale=None if inv_scale is None else inv_scale.to(g.device),
            )
            if bad:
                self._twin_nonfinite[p] = self._twin_nonfinite.get(p, 0) + bad

    # ---- state dicts -----------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a CompressedAdamW or a torch.optim.AdamW state dict (compressing it as configured).

        Hyperparameters come from the loaded dict; coatstate's format keys that it lacks (an
        AdamW dict) keep this optimizer's values. Moments are converted to this optimizer's
        format for each parameter; states are never cast to the parameter's dtype.
        """
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or "state" not in state_dict:
            raise ValueError("not an optimizer state dict: expected keys 'state' and 'param_groups'")
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(groups)} param groups, this optimizer has "
                f"{len(self.param_groups)}"
            )
        id_to_param: dict[Any, torch.Tensor] = {}
        new_groups = []
        for gi, (mine, saved) in enumerate(zip(self.param_groups, groups, strict=False)):
            if len(mine["params"]) != len(saved["params"]):
                raise ValueError(
                    f"param group {gi}: loaded state has {len(saved['params'])} parameters, this "
                    f"optimizer has {len(mine['params'])}"
                )
            id_to_param.update(zip(saved["params"], mine["params"], strict=False))
            merged = {k: v for k, v in saved.items() if k != "params"}
            for key, default in FORMAT_DEFAULTS.items():
                merged.setdefault(key, mine.get(key, default))
            merged.setdefault("decoupled_weight_decay", True)
            merged["params"] = mine["params"]
            new_groups.append(merged)
        self.param_groups = new_groups
        self.state.clear()
        self._fused_cache.clear()
        self._prepared.clear()
        param_group = {id(p): g for g in new_groups for p in g["params"]}
        for pid, saved_state in state_dict["state"].items():
            if pid not in id_to_param:
                raise ValueError(f"loaded state refers to parameter id {pid!r}, not in any param group")
            p = id_to_param[pid]
            self.state[p] = convert_param_state(saved_state, p, param_group[id(p)])


def convert_param_state(saved: dict, p: torch.Tensor, group: dict) -> dict:
    """One parameter's saved state, in this group's format for `p`, on p's device."""
    local = local_tensor(p)
    formats = moment_formats(group, global_shape(p))
    saved_group_size = group.get("group_size", 128)
    out: dict[str, Any] = {}
    for key, value in saved.items():
        if key == "step":
            step = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            on_device = local.is_cuda and group.get("fused") is not False
            out["step"] = (
                step.detach().to(dtype=torch.float32, device=local.device if on_device else "cpu").clone()
            )
    for name in MOMENTS:
        if name not in saved and f"{name}_codes" not in saved:
            continue
        src = {
            k: (_local_part(v, p).to(local.device) if isinstance(v, torch.Tensor) else v)
            for k, v in saved.items()
        }
        if not is_compressed(src, name) and tuple(src[name].shape) != tuple(local.shape):
            raise ValueError(
                f"state {name!r} has shape {tuple(src[name].shape)} but its parameter has shape "
                f"{tuple(local.shape)}"
            )
        if is_compressed(src, name) and tuple(src[f"{name}_codes"].shape) != tuple(local.shape):
            raise ValueError(
                f"state {name}_codes has shape {tuple(src[f'{name}_codes'].shape)} but its parameter has "
                f"shape {tuple(local.shape)}"
            )
        value = read_moment(src, name, saved_group_size).float()
        init_moment(out, name, local, formats[name])
        if formats[name] is None:
            out[name].copy_(value)
        else:
            same = (
                is_compressed(src, name)
                and src[f"{name}_codes"].dtype == formats[name].fmt.dtype
                and (f"{name}_exponents" in src) == formats[name].expand
                and src[f"{name}_scales"].shape == out[f"{name}_scales"].shape
            )
            if same:  # already in this format: copy the bits, never requantize (bit-exact resume)
                for k in (f"{name}_codes", f"{name}_scales", f"{name}_exponents"):
                    if k in src:
                        out[k].copy_(src[k])
            else:
                write_moment(out, name, value, formats[name])
    if "step" not in out:
        raise ValueError("parameter state has no 'step'")
    if is_dtensor(p):
        if any(k.endswith("_codes") for k in out):
            check_compressible(p, f"of global shape {tuple(p.shape)}")
        wrap_state(out, p)
    return out


def _local_part(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The part of a saved state tensor that belongs to this rank's shard of `p`: a DTensor's
    local shard, or for a DTensor `p` and a full (gathered) tensor, its rows of it."""
    if is_dtensor(value):
        return local_tensor(value)
    if is_dtensor(p) and value.ndim > 0:
        return local_chunk(value, p)
    return value


def _format_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    unknown = set(kwargs) - set(FORMAT_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown format option(s) {sorted(unknown)}; allowed: {sorted(FORMAT_DEFAULTS)}")
    return {**FORMAT_DEFAULTS, **kwargs}


def compress_adamw_state_dict(state_dict: dict[str, Any], **format_options: Any) -> dict[str, Any]:
    """A torch.optim.AdamW state dict -> a CompressedAdamW one (format options as its constructor's)."""
    options = _format_kwargs(format_options)
    groups, state = [], {}
    for saved in state_dict["param_groups"]:
        group = {**saved, **options}
        groups.append(group)
        for pid in saved["params"]:
            if pid not in state_dict["state"]:
                continue
            s = state_dict["state"][pid]
            formats = moment_formats(group, s["exp_avg"].shape)
            out = {
                "step": s["step"].clone()
                if isinstance(s["step"], torch.Tensor)
                else torch.tensor(float(s["step"]))
            }
            for name in MOMENTS:
                if name in s:
                    init_moment(out, name, s[name], formats[name])
                    write_moment(out, name, s[name].float(), formats[name])
            state[pid] = out
    return {"state": state, "param_groups": groups}


def to_adamw_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A CompressedAdamW state dict -> one torch.optim.AdamW loads (moments decompressed to fp32)."""
    groups, state = [], {}
    for saved in state_dict["param_groups"]:
        groups.append({k: v for k, v in saved.items() if k not in FORMAT_DEFAULTS})
        g = saved.get("group_size", 128)
        for pid in saved["params"]:
            if pid not in state_dict["state"]:
                continue
            s = state_dict["state"][pid]
            out = {"step": s["step"]}
            for name in MOMENTS:
                if name in s or f"{name}_codes" in s:
                    out[name] = read_moment(s, name, g).float().clone()
            state[pid] = out
    return {"state": state, "param_groups": groups}
