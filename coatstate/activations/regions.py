"""What compress_activations holds for a saved tensor until backward: regions of storage (packed
as FP8 or bfloat16, recomputed from another region, or kept) and the handles autograd stores.
Split from coatstate/activations.py, which creates and reads them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from coatstate.activations.policy import Granularity

_TENSOR, _BF16 = Granularity.TENSOR, Granularity.BF16


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
    """A region held as FP8 codes and power-of-two scale bytes (codec in coatstate.formats.activation)."""

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
        if self.granularity is _BF16:
            return self.codes.numel() * 2
        if self.kernel:
            return self.codes.numel() + (self.granularity is _TENSOR)
        return self.codes.numel() + self.scales.numel()


@dataclasses.dataclass(eq=False)
class _Recomputed(_Region):
    """A region that is `func(source, **kwargs)`: recomputed in backward from a held input."""

    func: object = None
    kwargs: dict | None = None
    source: _Handle | None = None
    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()


@dataclasses.dataclass(eq=False)
class _KeptRegion(_Region):
    """A region the policy keeps uncompressed: later saves inside it are kept without recounting."""

    reason: str = ""


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
