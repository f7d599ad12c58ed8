"""compress_activations: tensors autograd saves for backward are held in FP8 until backward.

    with coatstate.compress_activations() as ctx:    # COAT's mixed granularity by default
        loss = model(x)
    loss.backward()
    print(ctx.stats.summary())

How it works: a torch.autograd.graph.saved_tensors_hooks pair packs each saved tensor and
unpacks it when backward needs it; a TorchFunctionMode records which op is running, and for ops
that say nothing by themselves (a mul) the innermost nn.Module.forward on the Python stack gives
the kind, so the policy (coatstate.activation_policy) can pick the granularity by op kind. On
CUDA the Triton kernels of coatstate.kernels.activation_pack do the work, elsewhere their
pure-torch twins in coatstate.activation_policy.

What is compressed is a REGION of memory, not a tensor: a dense tensor's own bytes, or, for a
strided view such as the q, k and v that split one qkv projection, the whole storage it views
(when that storage is at most 4x the view; otherwise a contiguous copy of the view). Every later
save of memory inside a held region (the same tensor saved by several ops, views, transposes, the
k and v next to a q) shares it: the first save decides the granularity. In backward a region is
unpacked once for all the views that autograd unpacks together (a weak cache).

Recomputed instead of stored: the output of an activation function (GELU, SiLU, ...) whose input
the same call saved compressed, when a later op (the next linear) saves that output: backward
applies the function again to the unpacked input (`ActivationPolicy.recompute`).

What is never compressed (each is reported in `stats.kept_reasons`):
- parameters, buffers and views or casts of them; tensors created before the context was entered (the
  model's inputs; told apart by autograd's node sequence numbers); leaves that require grad;
  autocast's casts of parameters: they stay alive anyway (compressing would ADD memory);
- integer/bool/FP8 tensors, tensors below `min_numel`, expanded (stride-0) views;
- tensors whose op kind the policy says to keep (cross_entropy's log-probabilities by default).
A kept tensor is stored detached with its version counter; if it was modified in place before
backward, unpacking raises RuntimeError, as autograd itself would (saved-tensor hooks switch
autograd's own check off). Compressed regions are snapshots taken at save time.

Works with non-reentrant torch.utils.checkpoint (the region's tensors go to checkpoint's own
hooks, which take precedence, and pass through). Around a torch.compile'd call the compiled
graph's saved tensors are compressed at run time with the policy's `other` granularity (the op
kind is not visible there); entering the context INSIDE a compiled function raises a
RuntimeError instead of silently doing nothing.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from coatstate import activation_policy as codec
from coatstate.activation_policy import (
    ActivationPolicy,
    ActivationStats,
    Granularity,
    OpKind,
    kind_of_function,
    kind_of_module,
)

__all__ = ["ActivationPolicy", "ActivationStats", "Granularity", "OpKind", "compress_activations"]

_VIEW_OR_COPY_NODES = frozenset(
    "TBackward0 ViewBackward0 ToCopyBackward0 TransposeBackward0 PermuteBackward0 ExpandBackward0 "
    "SliceBackward0 SelectBackward0 UnsqueezeBackward0 SqueezeBackward0 SqueezeBackward1 "
    "AsStridedBackward0 UnsafeViewBackward0 ReshapeAliasBackward0 AliasBackward0".split()
)
_COMPRESSIBLE = (torch.float32, torch.bfloat16, torch.float16)
_MODULE_KINDS: dict = {}  # code object -> OpKind of the module whose forward it is, or None
_SLOTS = 4096  # per-tensor scale slots per device buffer (kernel path)
_MAX_STORAGE_PER_VIEW = 4  # a strided view packs its whole storage only up to this many times its size


def _derived_from_parameter(x: torch.Tensor) -> bool:
    """True if x is a chain of views/dtype casts of a leaf that requires grad (autocast's weights)."""
    node = x.grad_fn
    for _ in range(6):
        if node is None:
            return False
        name = node.name()
        if name == "torch::autograd::AccumulateGrad":
            return True
        if name not in _VIEW_OR_COPY_NODES:
            return False
        nexts = [n for n, _ in node.next_functions if n is not None]
        if len(nexts) != 1:
            return False
        node = nexts[0]
    return False


def _layout(x: torch.Tensor) -> tuple[int, int, bool, int]:
    """(first, last) element offsets x touches in its storage, whether it covers them densely
    (a permutation of a contiguous block), and its row length: the size of its stride-1 dim
    (1 if it has none)."""
    off = x.storage_offset()
    dims = sorted((st, size) for size, st in zip(x.shape, x.stride(), strict=True) if size > 1)
    row = dims[0][1] if dims and dims[0][0] == 1 else 1
    if x.is_contiguous():
        return off, off + x.numel() - 1, True, row
    expected, dense = 1, True
    for st, size in dims:
        dense &= st == expected
        expected *= size
    return off, off + sum((size - 1) * st for st, size in dims), dense, row


@dataclasses.dataclass(eq=False)
class _Region:
    """Elements [start, stop) of one storage, viewed as `dtype`, as they were at `version`."""

    storage: StorageWeakRef
    start: int
    stop: int
    dtype: torch.dtype
    device: torch.device
    version: int
    shared: bool = False  # saved more than once: unpacked values are cached (weakly) for the others
    cache: StorageWeakRef | None = None  # the last unpacked copy, while backward still holds it

    def holds(self, x: torch.Tensor, lo: int, hi: int) -> bool:
        return (
            self.start <= lo
            and hi < self.stop
            and x.dtype == self.dtype
            and x._version == self.version
            and not self.storage.expired()
        )

    def cached(self) -> torch.Tensor | None:
        if self.cache is None or self.cache.expired():
            return None
        storage = torch.UntypedStorage._new_with_weak_ptr(self.cache.cdata)
        if storage is None:
            return None
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        return empty.set_(storage, 0, (self.stop - self.start,), (1,))


@dataclasses.dataclass(eq=False)
class _Packed(_Region):
    """A region held as FP8 codes and power-of-two scale bytes (codec in activation_policy)."""

    granularity: Granularity = Granularity.TENSOR
    codes: torch.Tensor | None = None  # kernels: uint8 codes (+ group scale bytes); twin: FP8 codes
    scales: torch.Tensor | None = None  # kernels: the slot buffer of per-tensor scales; twin: scales
    slot: int = 0
    row: int = 1  # elements per row (groups never cross one)
    group_size: int = 16
    fmt: object = None
    kernel: bool = False

    @property
    def nbytes(self) -> int:
        if self.kernel:
            return self.codes.numel() + (self.granularity is Granularity.TENSOR)
        return self.codes.numel() + self.scales.numel()


@dataclasses.dataclass(eq=False)
class _Recomputed(_Region):
    """A region that is `func(source, **kwargs)`: recomputed in backward from a held input."""

    func: object = None
    kwargs: dict | None = None
    source: _Handle | weakref.ref | None = None  # weak until a save uses the region
    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()


@dataclasses.dataclass(eq=False)
class _KeptRegion(_Region):
    """A region the policy keeps uncompressed: later saves inside it are kept without recounting."""

    reason: str = ""


@dataclasses.dataclass(eq=False)
class _Handle:
    """What autograd holds for one compressed save: its region and how to view it."""

    region: _Region
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # element offset of the view inside the region


@dataclasses.dataclass(eq=False)
class _Kept:
    """A tensor held as is (detached), with its version at save time."""

    tensor: torch.Tensor
    version: int
    reason: str
    region: _KeptRegion | None = None  # keeps the region's entry alive for later saves inside it


class _OpRecorder(TorchFunctionMode):
    """Records the outermost torch function running (the mode is off while it runs)."""

    def __init__(self, owner: compress_activations) -> None:
        super().__init__()
        self.owner = owner
        self.current: OpKind | None = None
        self.qk_ptrs: tuple[int, ...] = ()  # data pointers of an attention call's q and k
        self.qk_nodes: tuple = ()  # and their grad_fns
        self.packed: tuple[torch.Tensor, _Handle] | None = None  # first compressed save of this call
        self._kinds: dict = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = kind_of_function(func)
        if kind is OpKind.OTHER:  # the common case (views, adds, ...): calls never nest here, and
            return func(*args, **kwargs)  # every other call restores `current` (None) on return
        previous = self.current, self.qk_ptrs, self.qk_nodes, self.packed
        self.current, self.packed = kind, None
        if kind is OpKind.ATTENTION:
            qk = list(args[:2]) + [kwargs.get(name) for name in ("query", "key")[len(args[:2]) :]]
            qk = [t for t in qk if isinstance(t, torch.Tensor)]
            self.qk_ptrs = tuple(t.data_ptr() for t in qk)
            self.qk_nodes = tuple(t.grad_fn for t in qk if t.grad_fn is not None)
        try:
            out = func(*args, **kwargs)
            if kind is OpKind.ACTIVATION and self.packed is not None:
                self.owner._note_recomputable(func, args, kwargs, out, *self.packed)
            return out
        finally:
            self.current, self.qk_ptrs, self.qk_nodes, self.packed = previous

    def is_query_or_key(self, x: torch.Tensor) -> bool:
        """x is the q or k of the running attention call, or autocast's cast of one."""
        if x.data_ptr() in self.qk_ptrs:
            return True
        node = x.grad_fn
        if node is not None and node.name() == "ToCopyBackward0":
            node = node.next_functions[0][0]
        return node is not None and any(node is n for n in self.qk_nodes)


def _module_kind(frame) -> OpKind:
    """Kind of the innermost nn.Module whose forward is on the Python stack from `frame` up."""
    for _ in range(10):
        if frame is None:
            break
        code = frame.f_code
        kind = _MODULE_KINDS.get(code, False)
        if kind is False:  # first sight of this code: is it a module's forward?
            owner = frame.f_locals.get("self") if code.co_name == "forward" else None
            kind = _MODULE_KINDS[code] = kind_of_module(owner) if isinstance(owner, torch.nn.Module) else None
        if kind is not None:
            return kind
        frame = frame.f_back
    return OpKind.OTHER


def _sequence_now() -> int:
    """Sequence number the next autograd node created on this thread gets."""
    with torch.enable_grad():
        return torch.empty(0, requires_grad=True).view(0).grad_fn._sequence_nr() + 1


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
        self._regions: dict[int, list[weakref.ref]] = {}  # storage pointer -> held regions in it
        self._recipes: dict[int, _Recomputed] = {}  # storage pointer -> how to recompute its values
        self._first_seq = 0  # autograd nodes numbered below this existed before __enter__
        self._thread = None
        self._slots: dict = {}  # device -> (amax int32 slots, scale byte slots, next free slot)
        self._recorder: _OpRecorder | None = None
        self._hooks = None

    # -- context ---------------------------------------------------------------------------
    def __enter__(self) -> compress_activations:
        if torch.compiler.is_compiling():
            _refuse_compiled()
        if self._hooks is not None:
            raise RuntimeError("this compress_activations context is already active; create a new one")
        self._first_seq, self._thread = _sequence_now(), threading.get_ident()
        self._recorder = _OpRecorder(self)
        self._recorder.__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._recorder.__exit__(*exc)
        self._hooks, self._recorder = None, None
        self._regions.clear()
        self._recipes.clear()
        self._slots.clear()

    def _kind(self) -> OpKind:
        kind = self._recorder.current if self._recorder is not None else None
        if kind is None or kind is OpKind.OTHER:
            return _module_kind(sys._getframe(2))  # from the op's caller up
        return kind

    # -- pack ------------------------------------------------------------------------------
    def _keep(self, x: torch.Tensor, reason: str, count_bytes: int | None = None) -> _Kept:
        self.stats.kept += 1
        self.stats.kept_reasons[reason] += 1
        self.stats.bytes_kept[reason] += x.numel() * x.element_size() if count_bytes is None else count_bytes
        return _Kept(x.detach(), x._version, reason)

    def _always_kept(self, x: torch.Tensor) -> str | None:
        if x.dtype not in _COMPRESSIBLE:
            return "not float16/bfloat16/float32"
        node = x.grad_fn
        if node is None:
            if x.requires_grad:
                return "parameter or other leaf requiring grad"
            return "no grad_fn (buffers, frozen parameters, statistics such as mean, rstd, logsumexp)"
        if x.numel() < max(self.policy.min_numel, 1):
            return f"smaller than min_numel={self.policy.min_numel}"
        if node._sequence_nr() < self._first_seq and threading.get_ident() == self._thread:
            return "created before the context"
        if _derived_from_parameter(x):
            return "parameter cast or view"
        return None

    def _find(self, ptr: int, x: torch.Tensor, lo: int, hi: int) -> _Region | None:
        refs = self._regions.get(ptr)
        if refs:
            for ref in refs:
                region = ref()
                if region is not None and region.holds(x, lo, hi):
                    return region
        return None

    def _register(self, ptr: int, region: _Region) -> None:
        refs = self._regions.get(ptr)
        if refs is None:
            self._regions[ptr] = [weakref.ref(region)]
            return
        if len(refs) > 8:  # drop regions of freed storages that once lived at this address
            refs[:] = [r for r in refs if r() is not None and not r().storage.expired()]
        refs.append(weakref.ref(region))

    def _pack(self, x: torch.Tensor):
        if torch.compiler.is_compiling():
            _refuse_compiled()
        reason = self._always_kept(x)
        if reason is not None:
            return self._keep(x, reason)
        lo, hi, dense, row = _layout(x)
        if not dense and any(st == 0 and n > 1 for n, st in zip(x.shape, x.stride(), strict=True)):
            return self._keep(x, "expanded (stride-0) view")
        storage = x.untyped_storage()
        ptr = storage.data_ptr()
        region = self._find(ptr, x, lo, hi)
        if region is not None:
            self.stats.shared += 1
            region.shared = True
            return self._view_of(region, x)
        if dense:
            start, stop = lo, hi + 1
        else:
            stop = storage.nbytes() // x.element_size()
            start = 0 if stop <= _MAX_STORAGE_PER_VIEW * x.numel() else None
        kind = self._kind()
        granularity, label = self.policy.granularity(kind), kind.value
        if kind is OpKind.ATTENTION and not self._recorder.is_query_or_key(x):
            granularity, label = self.policy.attention_v_out, "attention_v_out"
        place = (StorageWeakRef(storage), start, stop, x.dtype, x.device, x._version)
        if granularity is Granularity.KEEP:
            reason = f"policy keeps {label}"
            if start is None:
                return self._keep(x, reason)
            kept = self._keep(x, reason, (stop - start) * x.element_size())
            kept.region = _KeptRegion(*place, reason=reason)
            self._register(ptr, kept.region)
            return kept
        if start is None:  # a sparse view of a large storage: pack a contiguous copy, unshared
            base = x.contiguous()
            place = (
                StorageWeakRef(base.untyped_storage()),
                0,
                base.numel(),
                x.dtype,
                x.device,
                base._version,
            )
            region = self._compress(base, place, granularity, row, label)
            return self._view_of(region, base)
        region = self._recompute_region(ptr, x, lo, hi)
        if region is None:
            region = self._compress(x, place, granularity, row, label)
        else:
            self.stats.recomputed += 1
            self.stats.bytes_recomputed += (stop - start) * x.element_size()
        self._register(ptr, region)
        return self._view_of(region, x)

    def _view_of(self, region: _Region, x: torch.Tensor):
        if isinstance(region, _KeptRegion):
            return _Kept(x.detach(), x._version, region.reason, region)
        handle = _Handle(region, tuple(x.shape), x.stride(), x.storage_offset() - region.start)
        recorder = self._recorder
        if recorder is not None and recorder.packed is None and isinstance(region, _Packed):
            recorder.packed = (x, handle)  # the running call saved x compressed (see _note_recomputable)
        return handle

    def _use_triton(self, x: torch.Tensor) -> bool:
        backend = self.policy.backend
        return backend == "triton" or (backend == "auto" and x.is_cuda)

    def _compress(
        self, x: torch.Tensor, place: tuple, granularity: Granularity, row: int, label: str
    ) -> _Packed:
        policy = self.policy
        start, n = place[1], place[2] - place[1]
        self.stats.packed += 1
        self.stats.packed_by_kind[f"{label}/{granularity.value}"] += 1
        self.stats.bytes_original += n * x.element_size()
        row = row if 0 < row and n % row == 0 else n
        fields = {"granularity": granularity, "row": row, "group_size": policy.group_size, "fmt": policy.fmt}
        if self._use_triton(x):
            from coatstate.kernels import activation_pack as K

            base = x if x.storage_offset() == start else x.as_strided((n,), (1,), start)
            if granularity is Granularity.TENSOR:
                amax, scales, slot = self._slot(x.device)
                codes = K.pack_tensor_flat(base, n, policy.fmt, amax, scales, slot)
                packed = _Packed(*place, codes=codes, scales=scales, slot=slot, kernel=True, **fields)
            else:
                codes = K.pack_groups_flat(base, n, row, policy.group_size, policy.fmt)
                packed = _Packed(*place, codes=codes, kernel=True, **fields)
        elif granularity is Granularity.TENSOR:
            codes, scales = codec.pack_tensor(x.as_strided((n,), (1,), start), policy.fmt)
            packed = _Packed(*place, codes=codes, scales=scales, **fields)
        else:
            rows2d = x.as_strided((n // row, row), (row, 1), start)
            codes, scales = codec.pack_groups(rows2d, policy.group_size, policy.fmt)
            packed = _Packed(*place, codes=codes, scales=scales, **fields)
        self.stats.bytes_packed += packed.nbytes
        return packed

    def _slot(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A zeroed int32 maximum and a scale byte for one per-tensor pack (one allocation per
        _SLOTS tensors instead of two per tensor)."""
        amax, scales, used = self._slots.get(device, (None, None, _SLOTS))
        if used == _SLOTS:
            amax = torch.zeros(_SLOTS, dtype=torch.int32, device=device)
            scales = torch.empty(_SLOTS, dtype=torch.uint8, device=device)
            used = 0
        self._slots[device] = (amax, scales, used + 1)
        return amax, scales, used

    # -- recomputation of activation-function outputs --------------------------------------
    def _note_recomputable(self, func, args, kwargs, out, saved: torch.Tensor, source: _Handle) -> None:
        """`out = func(args[0], **kwargs)` and this call saved args[0] compressed: remember how to
        recompute `out` from it, in case a later op saves `out`."""
        if not self.policy.recompute or not isinstance(out, torch.Tensor) or kwargs.get("inplace"):
            return
        if len(args) != 1 or args[0].data_ptr() != saved.data_ptr() or out.data_ptr() == saved.data_ptr():
            return
        if not isinstance(source.region, _Packed) or out.dtype not in _COMPRESSIBLE:
            return
        lo, hi, dense, _ = _layout(out)
        if not dense or out.numel() == 0:
            return
        storage = out.untyped_storage()
        region = _Recomputed(
            StorageWeakRef(storage),
            lo,
            hi + 1,
            out.dtype,
            out.device,
            out._version,
            func=func,
            kwargs=dict(kwargs),
            source=weakref.ref(source),
            shape=tuple(out.shape),
            stride=out.stride(),
        )
        self._recipes[storage.data_ptr()] = region

    def _recompute_region(self, ptr: int, x: torch.Tensor, lo: int, hi: int) -> _Recomputed | None:
        region = self._recipes.get(ptr)
        if region is None or not region.holds(x, lo, hi):
            return None
        del self._recipes[ptr]
        region.source = region.source()  # held from now on: backward recomputes from it
        return region if region.source is not None else None

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
        flat = self._region_values(saved.region)
        return flat.as_strided(saved.shape, saved.stride, saved.offset)

    def _region_values(self, region: _Region) -> torch.Tensor:
        """The region's values as a flat tensor (unpacked once while backward holds them)."""
        if region.shared:
            flat = region.cached()
            if flat is not None:
                return flat
        if isinstance(region, _Recomputed):
            with torch.no_grad():
                out = region.func(self._unpack(region.source), **region.kwargs).to(region.dtype)
            if out.stride() != region.stride:
                out = torch.empty_strided(
                    region.shape, region.stride, dtype=out.dtype, device=out.device
                ).copy_(out)
            flat = out.as_strided((out.numel(),), (1,), out.storage_offset())
        elif region.kernel:
            from coatstate.kernels import activation_pack as K

            if region.granularity is Granularity.TENSOR:
                flat = K.unpack_tensor_flat(
                    region.codes, region.scales, region.slot, region.fmt, region.dtype
                )
            else:
                n = region.stop - region.start
                flat = K.unpack_groups_flat(
                    region.codes, n, region.row, region.group_size, region.fmt, region.dtype
                )
        elif region.granularity is Granularity.TENSOR:
            flat = codec.unpack_tensor(region.codes, region.scales, region.dtype)
        else:
            flat = codec.unpack_groups(region.codes, region.scales, region.group_size, region.dtype).reshape(
                -1
            )
        if region.shared:
            region.cache = StorageWeakRef(flat.untyped_storage())
        return flat


_COMPILE_ERROR = (
    "compress_activations cannot run inside a torch.compile'd function (its hooks would be traced "
    "away or do nothing): enter it OUTSIDE the compiled call, e.g. `with compress_activations(): "
    "loss = compiled_model(x)`; the compiled graph's saved tensors are then compressed at run time."
)


@torch._dynamo.disable
def _refuse_compiled() -> None:
    """Raised at run time: dynamo leaves this call out of the graph instead of tracing the raise."""
    raise RuntimeError(_COMPILE_ERROR)
