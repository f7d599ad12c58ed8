"""HostOffloadAdamW: CompressedAdamW with its states (moments, master correction) in host memory,
stepped on the CPU during backward.

It is built by composition: an inner CompressedAdamW steps host copies of the parameters (the
CPU path of CompressedAdamW, so the bits are that path's), and this class moves gradients to the
host and weights back (coatstate.optim.offload_pipeline). It subclasses CompressedAdamW only so
that what accepts a CompressedAdamW accepts it (coatstate.save/load keep the compressed states
as they are, the checkpoint class check, GradScaler's optimizer contract); every method that
touches states is overridden to go through the inner optimizer.

What cannot be exact is refused, as gradient release refuses it (coatstate.optim.release):
- gradient accumulation: a parameter steps during the backward that produced its gradient, so a
  second backward before opt.step() would add to a gradient already applied;
- GradScaler: the step runs before the scaler can unscale or skip it;
- a global-norm clip after backward (torch.nn.utils.clip_grad_norm_ finds no gradients):
  `max_grad_norm` clips each gradient by the PREVIOUS iteration's global norm instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from coatstate.distributed import is_dtensor
from coatstate.optim.adamw import CompressedAdamW
from coatstate.optim.offload_pipeline import HostArena, HostPipeline, Timings

_ACCUMULATION = (
    "coatstate: HostOffloadAdamW stepped this parameter during an earlier backward, and a second "
    "backward reached it before opt.step(): that is gradient accumulation, which offload cannot do "
    "exactly (the first micro-batch has already been applied on the host). Call opt.step() after "
    "every backward (raise the micro-batch instead: activation checkpointing frees the memory), or "
    "use CompressedAdamW without offload to accumulate."
)
_GRAD_SCALER = (
    "coatstate: GradScaler does not work with HostOffloadAdamW (each parameter steps on the host "
    "during backward, before the scaler can unscale or skip the step): train in bfloat16, which "
    "needs no scaler, or use CompressedAdamW without offload"
)
_NOT_HERE = ("gradient_release", "foreach")
"""CompressedAdamW options that offload replaces (it always steps per parameter in backward)."""
_SHARED = "params"
"""The one param-group key whose values differ between this optimizer and the inner one."""


class HostOffloadAdamW(CompressedAdamW):
    """CompressedAdamW whose moments and master correction live in (pinned) host memory.

    Each parameter's gradient is copied to the host on a side stream as soon as backward has
    produced it (a post-accumulate-grad hook) and freed on the device; a worker thread runs the
    host step, overlapped with the rest of backward, and copies the updated weight back.
    `step()` waits for all of it, so the next forward reads updated weights. The GPU then holds
    the weights, the gradients in flight and the activations; the host holds a copy of the
    weights, one gradient buffer per parameter and the compressed states. The arithmetic is
    CompressedAdamW's CPU path: parameters and states equal those of a CompressedAdamW on CPU
    given the same gradients, bit for bit. `state_dict()`, `load_state_dict()` and
    `coatstate.save`/`load` read and write CompressedAdamW's format: a checkpoint moves between
    the two freely.

    Args:
        params (`Iterable`): parameters or param groups, on one device (one GPU; CPU tensors work
            too, with synchronous copies). DTensor (FSDP2) parameters are refused.
        max_grad_norm (`float | None`): scale each gradient by min(1, max_grad_norm / norm), with
            the global norm of the PREVIOUS iteration's gradients (no clipping at the first);
            `torch.nn.utils.clip_grad_norm_` after backward would find no gradients. Gradients
            set by hand before `step()` count and are clipped the same way.
        **kwargs: CompressedAdamW's (lr, betas, eps, weight_decay, amsgrad, maximize, compress,
            formats, min_numel, master_bits, ...). `fused=True` and `gradient_release` are
            refused: the step runs on the host, always per parameter.

    Returns:
        The optimizer. `step()` returns the closure's loss (or None); `timings()` says where the
        last iteration's offload time went.

    Raises:
        ValueError: a CompressedAdamW argument out of range, `fused=True`, `gradient_release`,
            `foreach`, or parameters on several devices.
        TypeError: DTensor parameters.
        RuntimeError: gradient accumulation (at the second backward), GradScaler (at `step()`),
            or an error of a host step (at `step()`).

    Example:
        >>> model = coatstate.cast_model(torch.nn.Linear(256, 256))  # bf16 weights
        >>> opt = coatstate.HostOffloadAdamW(model.parameters(), lr=3e-4, master_bits=24)
        >>> model(torch.randn(8, 256, dtype=torch.bfloat16)).square().mean().backward()  # steps run
        >>> opt.step()  # waits for the host steps and the copies back
        >>> opt.zero_grad()
    """

    checkpoint_class = "CompressedAdamW"
    """what a checkpoint records: the states are CompressedAdamW's, and either class loads them"""

    def __init__(self, params: Iterable, *, max_grad_norm: float | None = None, **kwargs: Any) -> None:
        for key in _NOT_HERE:
            if kwargs.get(key) not in (None, False):
                raise ValueError(
                    f"HostOffloadAdamW does not take {key}={kwargs[key]!r}: it always steps each "
                    "parameter on the host during backward; leave it out"
                )
        if kwargs.get("fused"):
            raise ValueError(
                "HostOffloadAdamW does not take fused=True: the step runs on the host (CompressedAdamW's "
                "CPU path); leave fused out"
            )
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a positive float; got {max_grad_norm!r}")
        self._inner: CompressedAdamW | None = None  # add_param_group (run by the base) checks it
        super().__init__(params, **kwargs)
        flat = [p for g in self.param_groups for p in g["params"]]
        if any(is_dtensor(p) for p in flat):
            raise TypeError(
                "HostOffloadAdamW is for one device: DTensor (FSDP2) parameters are not supported; "
                "use FSDP2's own CPUOffloadPolicy or CompressedAdamW without offload"
            )
        devices = {p.device for p in flat}
        if len(devices) > 1:
            raise ValueError(
                f"HostOffloadAdamW needs every parameter on one device; got {sorted(map(str, devices))}"
            )
        self._pipeline = HostPipeline(devices.pop() if devices else torch.device("cpu"))
        need = 2 * sum(p.numel() * p.element_size() for p in flat)  # weights and their gradients
        chunk = min(1 << 30, 1 << max(need - 1, 1).bit_length())  # a small model: a small chunk
        self._arena = HostArena(pin=self._pipeline.cuda, chunk_bytes=chunk)
        """host weights and gradient buffers (the states, never copied to the device, stay pageable)"""
        self._host: dict[int, torch.Tensor] = {}
        """device parameter id -> its host copy, the parameter the inner optimizer steps"""
        self._grad_buffers: dict[int, torch.Tensor] = {}
        """device parameter id -> the host buffer its gradient lands in (made at its first step)"""
        self._marks: dict[int, tuple[int, int]] = {}
        """device parameter id -> (version, address) when its host copy last matched it"""
        self._hooks: list = []
        self._hooked: set[int] = set()
        self._stepped: set[int] = set()
        self._norm_sq: torch.Tensor | None = None
        self._previous_norm: torch.Tensor | None = None
        self.max_grad_norm = max_grad_norm
        self._last_timings = Timings()
        self._inner = CompressedAdamW(self._host_groups(self.param_groups), **kwargs)
        self._hook_new_params()
        self._refresh_state()

    # ---- the host side ------------------------------------------------------------------------
    def _host_copy(self, p: torch.Tensor) -> torch.Tensor:
        if id(p) not in self._host:
            host = self._arena.empty_like(p)
            host.copy_(p.detach())
            self._host[id(p)] = host
            self._marks[id(p)] = (p._version, p.data_ptr())
        return self._host[id(p)]

    def _host_groups(self, groups: list[dict]) -> list[dict]:
        """The inner optimizer's groups: these groups' options with host copies for params."""
        options = [{k: v for k, v in g.items() if k != _SHARED} for g in groups]
        hosts = [[self._host_copy(p) for p in g[_SHARED]] for g in groups]
        return [{**o, _SHARED: h} for o, h in zip(options, hosts, strict=True)]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if self._inner is not None:  # (during __init__ the inner optimizer is built after the groups)
            self._inner.add_param_group(self._host_groups(self.param_groups[-1:])[0])
            self._hook_new_params()
            self._refresh_state()

    def _sync_options(self) -> None:
        """Copy every option of these groups (lr, betas, ... as a scheduler or the user set them) to
        the inner optimizer's groups; only `params` differ. A tensor lr is shared, not copied."""
        for mine, inner in zip(self.param_groups, self._inner.param_groups, strict=True):
            for key, value in mine.items():
                if key != _SHARED:
                    inner[key] = value

    def _refresh_state(self) -> None:
        """self.state[device param] is the inner optimizer's state dict of its host copy (the same
        dict object), so that state_dict(), state_bytes() and inspection see the host states."""
        self.state.clear()
        for g in self.param_groups:
            for p in g[_SHARED]:
                host = self._host[id(p)]
                if host in self._inner.state:
                    self.state[p] = self._inner.state[host]

    def timings(self) -> Timings:
        """Where the last iteration's offload time went: host step, copies each way, the wait in
        step(), bytes moved (coatstate.optim.offload_pipeline.Timings)."""
        return self._last_timings

    def host_bytes(self) -> dict[str, int]:
        """Host memory this optimizer holds, in bytes: `states` (moments, master correction),
        `weights` (the host copies), `grad_buffers` (one per parameter that has stepped) and
        `reserved` (what the buffers of weights and gradients take, chunk tails included)."""
        size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {
            "states": self.state_bytes(),
            "weights": size(self._host.values()),
            "grad_buffers": size(self._grad_buffers.values()),
            "reserved": self._arena.reserved,
        }

    # ---- gradients leave the device ----------------------------------------------------------
    def _hook_new_params(self) -> None:
        for g in self.param_groups:
            for p in g[_SHARED]:
                if id(p) not in self._hooked and p.requires_grad:
                    self._hooked.add(id(p))
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, p: torch.Tensor) -> None:
        """A post-accumulate-grad hook: backward has produced p's gradient."""
        if p.grad is None:
            return
        if id(p) in self._stepped:
            raise RuntimeError(_ACCUMULATION)
        self._ship(p)

    @torch.no_grad()
    def _ship(self, p: torch.Tensor) -> None:
        """Clip p's gradient, send it (and p itself, if written since the host copy matched it) to
        the host, free it on the device and queue p's host step."""
        if not self._stepped:
            self._sync_options()  # the first parameter of an iteration: options as they are now
        self._stepped.add(id(p))
        grad = p.grad
        if grad.is_sparse or torch.is_complex(p):
            raise TypeError("HostOffloadAdamW steps dense real parameters only (sparse or complex found)")
        if self.max_grad_norm is not None:
            # gradient release's arithmetic (coatstate.optim.release), so the two clip alike
            sq = grad.detach().float().square().sum()
            self._norm_sq = sq if self._norm_sq is None else self._norm_sq + sq
            if self._previous_norm is not None:
                factor = (self.max_grad_norm / (self._previous_norm + 1e-6)).clamp(max=1.0)
                grad.mul_(factor.to(grad.dtype))
        host = self._host[id(p)]
        buffer = self._grad_buffers.get(id(p))
        if buffer is None or buffer.dtype != grad.dtype:
            buffer = self._grad_buffers[id(p)] = self._arena.empty_like(grad)
        pairs = [(grad, buffer)]
        if self._marks[id(p)] != (p._version, p.data_ptr()):
            # written outside the optimizer (model.load_state_dict, an EMA swap): the host copy
            # follows, and the inner optimizer sees its own copy written, as CompressedAdamW would
            pairs.append((p.detach(), host))
        ready = self._pipeline.to_host(pairs)
        p.grad = None
        self._pipeline.submit(ready, lambda: self._host_step(p, host, buffer))

    def _host_step(self, p: torch.Tensor, host: torch.Tensor, grad: torch.Tensor) -> list:
        """On the worker: step p's host copy with the inner optimizer (its public step(), with only
        this parameter's gradient set), then send the weight back."""
        host.grad = grad
        try:
            self._inner.step()
        finally:
            host.grad = None
        self._marks[id(p)] = (p._version, p.data_ptr())  # the copy back goes through p.data: no bump
        return [(host, p.data)]

    # ---- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            self._pipeline.finish()
            raise RuntimeError(_GRAD_SCALER)
        for g in self.param_groups:  # gradients set by hand (no hook fired) step now, in order
            for p in g[_SHARED]:
                if p.grad is not None:
                    if id(p) in self._stepped:
                        self._pipeline.finish()
                        raise RuntimeError(_ACCUMULATION)
                    self._ship(p)
        try:
            self._last_timings = self._pipeline.finish()
        finally:
            if self._norm_sq is not None:
                self._previous_norm = self._norm_sq.sqrt()
                self._norm_sq = None
            self._stepped.clear()
            self._refresh_state()
        return loss

    # ---- what reads the inner optimizer -------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """CompressedAdamW's state dict of the host states (the same keys and tensors)."""
        self._pipeline.finish()  # no host step may be writing a state being read
        self._refresh_state()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a CompressedAdamW (or torch.optim.AdamW) state dict into the host states, as
        CompressedAdamW.load_state_dict does (a refused dict changes nothing)."""
        self._pipeline.finish()
        state_dict = dict(state_dict) if isinstance(state_dict, dict) else state_dict
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._sync_options()
        self._inner.load_state_dict(state_dict)
        for mine, inner in zip(self.param_groups, self._inner.param_groups, strict=True):
            params = mine[_SHARED]
            mine.clear()  # in place: schedulers hold these dicts
            mine.update({k: v for k, v in inner.items() if k != _SHARED}, **{_SHARED: params})
        self._refresh_state()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def nonfinite_parameters(self) -> list[dict[str, Any]]:
        """As CompressedAdamW.nonfinite_parameters, with `param` the device parameter."""
        device_of = {id(h): p for g in self.param_groups for p in g[_SHARED] for h in [self._host[id(p)]]}
        found = self._inner.nonfinite_parameters()
        for item in found:
            item["param"] = device_of.get(id(item["param"]), item["param"])
        return found

    def remove_hooks(self) -> None:
        """Remove the gradient hooks and stop the worker (the optimizer cannot step afterwards)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._pipeline.close()
