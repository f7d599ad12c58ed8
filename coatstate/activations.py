"""compress_activations: tensors autograd saves for backward are held in FP8 until backward.

    with coatstate.compress_activations() as ctx:    # COAT's mixed granularity by default
        loss = model(x)
    loss.backward()
    print(ctx.stats.summary())

How it works: a torch.autograd.graph.saved_tensors_hooks pair packs each saved tensor and
unpacks it when backward needs it; a TorchFunctionMode and global nn.Module hooks record which
op and module are running, so the policy (coatstate.activation_policy) can pick the granularity
by op kind. On CUDA the Triton kernels of coatstate.kernels.activation_pack do the work, elsewhere
their pure-torch twins in coatstate.formats.tensorwise.

What is never compressed (each is reported in `stats.kept_reasons`):
- parameters, buffers and views of them; the inputs of the outermost module; leaves that
  require grad; autocast's casts of parameters: they stay alive anyway (compressing would ADD
  memory);
- integer/bool tensors, tensors below `min_numel`, expanded (stride-0) views;
- tensors whose op kind the policy says to keep (cross_entropy's log-probabilities by default).
A kept tensor is stored detached with its version counter; if it was modified in place before
backward, unpacking raises RuntimeError, as autograd itself would (saved-tensor hooks switch
autograd's own check off). Memory saved several times (by several ops, or through views that
cover the same bytes such as x, x.view(...), x.t()) is compressed once; the first save decides
its granularity.

Works with non-reentrant torch.utils.checkpoint (the region's tensors go to checkpoint's own
hooks, which take precedence, and pass through). Around a torch.compile'd call the compiled
graph's saved tensors are compressed at run time with the policy's `other` granularity (the op
kind is not visible there); entering the context INSIDE a compiled function raises a
RuntimeError instead of silently doing nothing.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from coatstate.activation_policy import (
    ActivationPolicy,
    ActivationStats,
    Granularity,
    OpKind,
    kind_of_function,
    kind_of_module,
)
from coatstate.formats import tensorwise
from coatstate.formats.group import dequantize_groups, quantize_groups

__all__ = ["ActivationPolicy", "ActivationStats", "Granularity", "OpKind", "compress_activations"]

_VIEW_OR_COPY_NODES = frozenset(
    "TBackward0 ViewBackward0 ToCopyBackward0 TransposeBackward0 PermuteBackward0 ExpandBackward0 "
    "SliceBackward0 SelectBackward0 UnsqueezeBackward0 SqueezeBackward0 SqueezeBackward1 "
    "AsStridedBackward0 UnsafeViewBackward0 ReshapeAliasBackward0 AliasBackward0".split()
)


def _derived_from_parameter(x: torch.Tensor) -> bool:
    """True if x is a chain of views/dtype casts of a leaf that requires grad (autocast's weights)."""
    node = x.grad_fn
    for _ in range(6):
        if node is None:
            return False
        if type(node).__name__ == "AccumulateGrad" or node.name() == "torch::autograd::AccumulateGrad":
            return True
        if node.name() not in _VIEW_OR_COPY_NODES:
            return False
        nexts = [n for n, _ in node.next_functions if n is not None]
        if len(nexts) != 1:
            return False
        node = nexts[0]
    return False


def _dense_layout(x: torch.Tensor) -> tuple[torch.Tensor | None, tuple[int, ...] | None]:
    """(x permuted into memory order, the permutation) if x covers its bytes densely, else (None, None)."""
    if x.is_contiguous():
        return x, None
    if any(st == 0 and n > 1 for n, st in zip(x.shape, x.stride(), strict=False)):
        return None, None
    perm = tuple(sorted(range(x.dim()), key=lambda d: -x.stride(d)))
    xp = x.permute(perm)
    return (xp, perm) if xp.is_contiguous() else (None, None)


@dataclasses.dataclass(eq=False)
class _Packed:
    """One compressed region of memory, shared by every save that covers it."""

    granularity: Granularity
    codes: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype
    group_size: int
    storage: StorageWeakRef | None = None

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4


@dataclasses.dataclass(eq=False)
class _Kept:
    """A tensor held as is (detached), with its version at save time."""

    tensor: torch.Tensor
    version: int
    reason: str
    storage: StorageWeakRef | None = None


@dataclasses.dataclass(eq=False)
class _Handle:
    """What autograd holds for one save: a packed region plus how to view it as the saved tensor."""

    packed: _Packed
    base_shape: tuple[int, ...]
    inverse_perm: tuple[int, ...] | None


class _OpRecorder(TorchFunctionMode):
    """Records the outermost torch function running (the mode is off while it runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.current: OpKind | None = None
        self.qk_ptrs: tuple[int, ...] = ()  # data pointers of an attention call's q and k
        self.qk_nodes: tuple = ()  # and their grad_fns

    def __torch_function__(self, func, types, args=(), kwargs=None):
        previous, previous_qk, previous_nodes = self.current, self.qk_ptrs, self.qk_nodes
        self.current = kind_of_function(func)
        if self.current is OpKind.ATTENTION:
            kw = kwargs or {}
            qk = list(args[:2]) + [kw.get(name) for name in ("query", "key")[len(args[:2]):]]
            qk = [t for t in qk if isinstance(t, torch.Tensor)]
            self.qk_ptrs = tuple(t.data_ptr() for t in qk)
            self.qk_nodes = tuple(t.grad_fn for t in qk if t.grad_fn is not None)
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current, self.qk_ptrs, self.qk_nodes = previous, previous_qk, previous_nodes

    def is_query_or_key(self, x: torch.Tensor) -> bool:
        """x is the q or k of the running attention call, or autocast's cast of one."""
        if x.data_ptr() in self.qk_ptrs:
            return True
        node = x.grad_fn
        if node is not None and node.name() == "ToCopyBackward0":
            node = node.next_functions[0][0]
        return node is not None and any(node is n for n in self.qk_nodes)


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class compress_activations:  # noqa: N801  (a context manager used like a function)
    """Hold tensors saved for backward in FP8 inside this context (see the module docstring).

    Args:
        policy: an ActivationPolicy; keyword arguments override its fields, e.g.
            `compress_activations(attention="keep", fmt="e5m2", min_numel=0)`.
    The context object's `stats` (ActivationStats) reports what was packed and kept.
    """

    def __init__(self, policy: ActivationPolicy | None = None, **overrides) -> None:
        policy = policy if policy is not None else ActivationPolicy()
        if not isinstance(policy, ActivationPolicy):
            raise TypeError(f"policy must be an ActivationPolicy; got {type(policy).__name__}")
        fields = {f.name for f in dataclasses.fields(ActivationPolicy)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; ActivationPolicy fields are {sorted(fields)}")
        self.policy = dataclasses.replace(policy, **overrides)
        self.stats = ActivationStats()
        self._entries: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._kept_ptrs: set[int] = set()  # storages of parameters and buffers of modules that ran
        self._input_ptrs: set[int] = set()  # storages of the outermost module's inputs
        self._modules: list[torch.nn.Module] = []
        self._handles: list = []
        self._recorder: _OpRecorder | None = None
        self._hooks = None

    # -- context ---------------------------------------------------------------------------
    def __enter__(self) -> compress_activations:
        if torch.compiler.is_compiling():
            _refuse_compiled()
        if self._hooks is not None:
            raise RuntimeError("this compress_activations context is already active; create a new one")
        mod = torch.nn.modules.module
        self._handles = [
            mod.register_module_forward_pre_hook(self._module_enter),
            mod.register_module_forward_hook(self._module_exit, always_call=True),
        ]
        self._recorder = _OpRecorder()
        self._recorder.__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._recorder.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._hooks, self._recorder, self._handles, self._modules = None, None, [], []
        self._kept_ptrs.clear()
        self._input_ptrs.clear()

    def _module_enter(self, module: torch.nn.Module, args) -> None:
        if torch.compiler.is_compiling():  # traced by dynamo: nothing to record at trace time
            return
        if not self._modules:  # a new outermost forward: forget the previous one's inputs
            self._input_ptrs = {_storage_ptr(a) for a in args if isinstance(a, torch.Tensor)}
        self._modules.append(module)
        for t in (*module._parameters.values(), *module._buffers.values()):
            if t is not None:
                self._kept_ptrs.add(_storage_ptr(t))

    def _module_exit(self, module: torch.nn.Module, args, output) -> None:
        if torch.compiler.is_compiling():
            return
        if self._modules and self._modules[-1] is module:
            self._modules.pop()

    def _kind(self) -> OpKind:
        kind = self._recorder.current if self._recorder is not None else None
        if (kind is None or kind is OpKind.OTHER) and self._modules:
            return kind_of_module(self._modules[-1])
        return kind or OpKind.OTHER

    # -- pack ------------------------------------------------------------------------------
    def _keep(self, x: torch.Tensor, reason: str, storage: StorageWeakRef | None = None) -> _Kept:
        self.stats.kept += 1
        self.stats.kept_reasons[reason] += 1
        self.stats.bytes_kept[reason] += x.numel() * x.element_size()
        return _Kept(x.detach(), x._version, reason, storage)

    def _always_kept(self, x: torch.Tensor) -> str | None:
        ptr = _storage_ptr(x)
        if ptr in self._kept_ptrs or isinstance(x, torch.nn.Parameter):
            return "parameter or buffer"
        if ptr in self._input_ptrs:
            return "module input"
        if x.is_leaf and x.requires_grad:
            return "leaf requiring grad"
        if _derived_from_parameter(x):
            return "parameter cast or view"
        if not x.is_floating_point() or x.dtype.itemsize < 2:
            return "not float16/bfloat16/float32"
        if x.grad_fn is None and not x.requires_grad:
            return "no grad_fn (statistics: mean, rstd, logsumexp; no-grad temporaries)"
        if x.numel() < self.policy.min_numel:
            return f"smaller than min_numel={self.policy.min_numel}"
        return None

    def _pack(self, x: torch.Tensor):
        if torch.compiler.is_compiling():
            _refuse_compiled()
        reason = self._always_kept(x)
        if reason is not None:
            return self._keep(x, reason)
        base, perm = _dense_layout(x)
        if base is None and any(st == 0 and n > 1 for n, st in zip(x.shape, x.stride(), strict=False)):
            return self._keep(x, "expanded (stride-0) view")
        if base is not None:
            key = (x.device, x.dtype, x.data_ptr(), x.numel(), x._version)
        else:
            key = (x.device, x.dtype, x.data_ptr(), tuple(x.shape), x.stride(), x._version)
        entry = self._entries.get(key)
        if entry is not None and entry.storage is not None and not entry.storage.expired():
            self.stats.shared += 1
            if isinstance(entry, _Kept):
                return _Kept(x.detach(), x._version, entry.reason)
            return self._handle(entry, x, base, perm)
        storage = StorageWeakRef(x.untyped_storage())
        kind = self._kind()
        granularity = self.policy.granularity(kind)
        label = kind.value
        if kind is OpKind.ATTENTION and not self._recorder.is_query_or_key(x):
            granularity, label = self.policy.attention_v_out, "attention_v_out"
        if granularity is Granularity.KEEP:
            kept = self._keep(x, f"policy keeps {label}", storage)
            self._entries[key] = kept
            return kept
        packed = self._compress(base if base is not None else x.contiguous(), granularity)
        packed.storage = storage
        self._entries[key] = packed
        self.stats.packed += 1
        self.stats.packed_by_kind[f"{label}/{granularity.value}"] += 1
        self.stats.bytes_original += x.numel() * x.element_size()
        self.stats.bytes_packed += packed.nbytes
        return self._handle(packed, x, base, perm)

    def _handle(self, packed: _Packed, x: torch.Tensor, base, perm) -> _Handle:
        if perm is None:
            return _Handle(packed, tuple(x.shape), None)
        inverse = tuple(sorted(range(len(perm)), key=lambda d: perm[d]))
        return _Handle(packed, tuple(base.shape), inverse)

    def _use_triton(self, x: torch.Tensor) -> bool:
        backend = self.policy.backend
        return backend == "triton" or (backend == "auto" and x.is_cuda)

    def _compress(self, base: torch.Tensor, granularity: Granularity) -> _Packed:
        policy = self.policy
        if granularity is Granularity.TENSOR:
            flat = base.reshape(-1)
            if self._use_triton(base):
                from coatstate.kernels import activation_pack

                codes, scales = activation_pack.pack_tensorwise(flat, policy.fmt)
            else:
                codes, scales = tensorwise.quantize_tensorwise(flat, policy.fmt)
        else:
            rows2d = tensorwise.row_view(base)
            if self._use_triton(base):
                from coatstate.kernels import activation_pack

                codes, scales = activation_pack.pack_groups(rows2d, policy.group_size, policy.fmt)
            else:
                codes, scales, _ = quantize_groups(
                    rows2d.float(), policy.group_size, policy.fmt, expand=False
                )
        return _Packed(granularity, codes, scales, base.dtype, policy.group_size)

    # -- unpack ----------------------------------------------------------------------------
    def _unpack(self, saved):
        if isinstance(saved, _Kept):
            if saved.tensor._version != saved.version:
                t = saved.tensor
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an "
                    f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; "
                    f"expected version {saved.version} instead. compress_activations kept this tensor "
                    f"uncompressed ({saved.reason}), and saved-tensor hooks switch off autograd's own "
                    "check: do not modify it in place before backward (use an out-of-place op or .clone())."
                )
            return saved.tensor
        packed = saved.packed
        out = self._decompress(packed)
        out = out.reshape(saved.base_shape)
        return out if saved.inverse_perm is None else out.permute(saved.inverse_perm)

    def _decompress(self, packed: _Packed) -> torch.Tensor:
        triton_ok = self._use_triton(packed.codes)
        if packed.granularity is Granularity.TENSOR:
            if triton_ok:
                from coatstate.kernels import activation_pack

                return activation_pack.unpack_tensorwise(packed.codes, packed.scales, packed.dtype)
            return tensorwise.dequantize_tensorwise(packed.codes, packed.scales, packed.dtype)
        if triton_ok:
            from coatstate.kernels import activation_pack

            return activation_pack.unpack_groups(packed.codes, packed.scales, packed.group_size, packed.dtype)
        return dequantize_groups(packed.codes, packed.scales, None, packed.group_size).to(
            packed.dtype
        )


_COMPILE_ERROR = (
    "compress_activations cannot run inside a torch.compile'd function (its hooks would be traced "
    "away or do nothing): enter it OUTSIDE the compiled call, e.g. `with compress_activations(): "
    "loss = compiled_model(x)`; the compiled graph's saved tensors are then compressed at run time."
)


@torch._dynamo.disable
def _refuse_compiled() -> None:
    """Raised at run time: dynamo leaves this call out of the graph instead of tracing the raise."""
    raise RuntimeError(_COMPILE_ERROR)
