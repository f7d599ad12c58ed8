"""The unpack side of compress_activations (coatstate.activations.hooks): what backward gets back
for each save, from the regions of coatstate.activations.regions. A mixin of the context class, split
from hooks.py (which packs): it runs once per saved tensor in backward, so the common cases come
first and nothing is looked up twice."""

from __future__ import annotations

import torch

from coatstate.activations.policy import Granularity
from coatstate.activations.regions import _Kept, _Pending, _Recomputed, _Region, _StorageRef
from coatstate.formats import activation as codec

_TENSOR, _BF16 = Granularity.TENSOR, Granularity.BF16
_grad_enabled = torch.is_grad_enabled
_K = None  # coatstate.kernels.activation once imported


def kernels():
    """coatstate.kernels.activation, imported on first use (it imports triton)."""
    global _K
    if _K is None:
        from coatstate.kernels import activation as activation_kernels

        _K = activation_kernels
    return _K


class _Unpacker:
    """`_unpack`, the saved-tensor hook of backward; needs `_resolve_pending` of the context."""

    def _unpack(self, saved):
        cls = type(saved)
        if cls is _Pending:
            if saved.held is None:
                self._resolve_pending()
            saved = saved.held
            cls = type(saved)
        if cls is _Kept:
            if saved.tensor._version != saved.version:
                _raise_modified(saved)
            return saved.tensor
        region = saved.region
        flat = self._region_values(region)
        if region.layout is not None and not region.shared:  # unpacked in the save's own layout
            return flat
        return flat.as_strided(saved.shape, saved.stride, saved.offset)

    def _region_values(self, region: _Region) -> torch.Tensor:
        """A tensor whose storage holds the region's values (unpacked once while backward holds them):
        flat, or recomputed in the activation's shape, or for an unshared region with a `layout` in
        the layout of the one save that covers it (then _unpack returns it as it is)."""
        shared = region.shared
        if shared:
            flat = region.cached()
            if flat is not None:
                return flat
        if type(region) is _Recomputed:
            if _grad_enabled():  # (backward runs without grad unless create_graph=True)
                with torch.no_grad():
                    flat = self._recomputed_values(region)
            else:
                flat = self._recomputed_values(region)
        elif region.granularity is _BF16:
            flat = region.codes.to(region.dtype)
        elif region.kernel:
            out = None
            if region.layout is not None and not shared:
                out = region.codes.new_empty_strided(*region.layout, dtype=region.dtype)
            if region.granularity is _TENSOR:
                flat = (_K or kernels()).unpack_tensor_flat(
                    region.codes, region.scales, region.slot, region.fmt, region.dtype, out
                )
            else:
                n = region.stop - region.start
                flat = (_K or kernels()).unpack_groups_flat(
                    region.codes, n, region.row, region.group_size, region.fmt, region.dtype, out
                )
        elif region.granularity is _TENSOR:
            flat = codec.unpack_tensor(region.codes, region.scales, region.dtype)
        else:
            flat = codec.unpack_groups(region.codes, region.scales, region.group_size, region.dtype)
            flat = flat.reshape(-1)
        if shared:
            region.cache = _StorageRef(flat.untyped_storage())
        return flat

    def _recomputed_values(self, region: _Recomputed) -> torch.Tensor:
        """The activation function applied again to its unpacked input, in the region's layout (a
        fresh tensor: _unpack's as_strided and the cache work on its storage, no flat view needed)."""
        out = region.func(self._unpack(region.source), **region.kwargs)
        if out.dtype != region.dtype:
            out = out.to(region.dtype)
        if out.stride() != region.stride:
            like = torch.empty_strided(region.shape, region.stride, dtype=out.dtype, device=out.device)
            out = like.copy_(out)
        return out


def _raise_modified(saved: _Kept) -> None:
    t = saved.tensor
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; "
        f"expected version {saved.version} instead. compress_activations kept this tensor "
        f"uncompressed ({saved.reason}), and saved-tensor hooks switch off autograd's own "
        "check: do not modify it in place before backward (use an out-of-place op or .clone())."
    )
