"""What compress_activations holds for a saved tensor until backward: regions of storage (packed
as FP8 or bfloat16, recomputed from another region, or kept) and the handles autograd stores.
Split from coatstate/activations.py, which creates and reads them.

One of these is made per saved tensor (or per region) in the hot path of every forward, so they are
plain classes with __slots__ and positional constructors (a dataclass's keyword __init__ and
__dict__ cost microseconds per save), and storages are referred to by weak references held as
ints (cdata). `_layout` (what a view covers of its storage) is cached per shape and stride.
"""

from __future__ import annotations

import torch

from coatstate.activations.policy import Granularity

_expired = torch.UntypedStorage._expired
_LAYOUTS: dict = {}  # (shape, stride) -> _layout's answer: a model saves the same few layouts every step
_CONTIGUOUS_STRIDES: dict = {}  # shape -> the strides of a contiguous tensor of that shape
_MAX_CACHED = 4096  # entries of each of the two caches above (a run of ever new shapes starts over)


class _StorageRef:
    """A weak reference to a storage: torch.multiprocessing's StorageWeakRef without its detours
    (its expired() and __del__ go through the legacy TypedStorage classmethods)."""

    __slots__ = ("cdata",)

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.cdata = storage._weak_ref()

    def expired(self) -> bool:
        return _expired(self.cdata)

    def __del__(self, _free=torch.UntypedStorage._free_weak_ref) -> None:  # (bound: safe at exit)
        _free(self.cdata)


class _Region:
    """Elements [start, stop) of one storage, viewed as `dtype`, as they were at `version`. The
    storage is referred to weakly by `cdata` (as _StorageRef does, without an object per region)."""

    __slots__ = ("cdata", "start", "stop", "dtype", "device", "version", "shared", "cache", "__weakref__")

    def __init__(
        self, storage: torch.UntypedStorage, start: int, stop: int, dtype, device, version: int
    ) -> None:
        self.cdata = storage._weak_ref()
        self.start = start
        self.stop = stop
        self.dtype = dtype
        self.device = device
        self.version = version
        self.shared = False  # saved more than once: unpacked values are cached (weakly) for the others
        self.cache: _StorageRef | None = None  # the last unpacked copy, while backward still holds it

    layout: tuple | None = None  # (a _Packed's slot; None for the other regions)

    def expired(self) -> bool:
        """True once the storage has been freed (its address may then hold another)."""
        return _expired(self.cdata)

    def __del__(self, _free=torch.UntypedStorage._free_weak_ref) -> None:
        _free(self.cdata)

    def cached(self) -> torch.Tensor | None:
        if self.cache is None or _expired(self.cache.cdata):
            return None
        storage = torch.UntypedStorage._new_with_weak_ptr(self.cache.cdata)
        if storage is None:
            return None
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        return empty.set_(storage, 0, (self.stop - self.start,), (1,))


class _Packed(_Region):
    """A region held as FP8 codes and power-of-two scale bytes (codec in coatstate.formats.activation)."""

    __slots__ = ("granularity", "codes", "scales", "slot", "row", "group_size", "fmt", "kernel", "layout")

    def __init__(self, storage, start, stop, dtype, device, version, granularity, row, group_size, fmt):
        _Region.__init__(self, storage, start, stop, dtype, device, version)
        self.granularity: Granularity = granularity
        self.codes: torch.Tensor | None = None  # kernels: uint8 codes (+ group scale bytes); twin: FP8 codes
        self.scales: torch.Tensor | None = None  # kernels: the slot buffer of per-tensor scales; twin: scales
        self.slot = 0
        self.row = row  # elements per row (groups never cross one)
        self.group_size = group_size
        self.fmt = fmt
        self.kernel = False
        self.layout: tuple | None = None  # (shape, stride) of the save covering it: see hooks._compress


class _Recomputed(_Region):
    """A region that is `func(source, **kwargs)`: recomputed in backward from a held input."""

    __slots__ = ("func", "kwargs", "source", "shape", "stride")

    def __init__(self, storage, start, stop, dtype, device, version, func, kwargs, source, shape, stride):
        _Region.__init__(self, storage, start, stop, dtype, device, version)
        self.func = func
        self.kwargs: dict = kwargs
        self.source: _Handle = source
        self.shape: tuple[int, ...] = shape
        self.stride: tuple[int, ...] = stride


class _KeptRegion(_Region):
    """A region the policy keeps uncompressed: later saves inside it are kept without recounting."""

    __slots__ = ("reason",)

    def __init__(self, storage, start, stop, dtype, device, version, reason: str) -> None:
        _Region.__init__(self, storage, start, stop, dtype, device, version)
        self.reason = reason


class _Handle:
    """What autograd holds for one compressed save: its region and how to view it."""

    __slots__ = ("region", "shape", "stride", "offset", "__weakref__")  # (one per save: no __dict__)

    def __init__(self, region: _Region, shape: tuple, stride: tuple, offset: int) -> None:
        self.region = region
        self.shape = shape
        self.stride = stride
        self.offset = offset  # element offset of the view inside the region


class _Pending:
    """An attention input saved before its op's output, which tells q and k from v: `held` is
    filled in when the output is saved (or when anything else needs it first)."""

    __slots__ = ("tensor", "version", "held")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.version = tensor._version
        self.held: _Handle | _Kept | None = None


class _Kept:
    """A tensor held as is (detached), with its version at save time."""

    __slots__ = ("tensor", "version", "reason", "region")

    def __init__(self, tensor: torch.Tensor, version: int, reason: str, region: _KeptRegion | None = None):
        self.tensor = tensor
        self.version = version
        self.reason = reason
        self.region = region  # keeps the region's entry alive for later saves inside it


def _layout(shape: torch.Size, stride: tuple) -> tuple[int, bool, int, bool]:
    """(extent, dense, row, expanded) of a view with this shape and stride: its last element's
    offset from its first, whether it covers that span densely (a permutation of a contiguous
    block), its row length (the size of its stride-1 dim, 1 if it has none), and whether it is an
    expanded (stride-0) view. Cached per layout (a sort and a few generators otherwise, per save)."""
    entry = _LAYOUTS.get((shape, stride))
    if entry is not None:
        return entry
    dims = sorted((st, size) for size, st in zip(shape, stride, strict=True) if size > 1)
    row = dims[0][1] if dims and dims[0][0] == 1 else 1
    expected, dense = 1, True
    for st, size in dims:
        dense &= st == expected
        expected *= size
    expanded = not dense and any(st == 0 for st, _ in dims)
    if len(_LAYOUTS) >= _MAX_CACHED:
        _LAYOUTS.clear()
    entry = _LAYOUTS[(shape, stride)] = (sum((size - 1) * st for st, size in dims), dense, row, expanded)
    return entry


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides = _CONTIGUOUS_STRIDES.get(shape)
    if strides is None:
        if len(_CONTIGUOUS_STRIDES) >= _MAX_CACHED:
            _CONTIGUOUS_STRIDES.clear()
        strides = _CONTIGUOUS_STRIDES[shape] = torch.empty(shape, device="meta").stride()
    return strides
