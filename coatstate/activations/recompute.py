"""Recomputed instead of stored: the output of an activation function (GELU, SiLU, ...) whose input
compress_activations (coatstate.activations.hooks) saved compressed. A mixin of the context class,
split from hooks.py: the pack hook notes such an input under its op's autograd node
(`_note_source`), and when a later op (the next linear) saves that op's output, the save becomes a
_Recomputed region (`_recompute_region`) that backward fills by applying the function again."""

from __future__ import annotations

import math
import threading
import weakref

import torch

from coatstate.activations.policy import RECOMPUTABLE
from coatstate.activations.regions import _contiguous_strides, _Handle, _Recomputed

_RESHAPE_NODES = frozenset("ViewBackward0 UnsafeViewBackward0 ReshapeAliasBackward0 AliasBackward0".split())
_NODE_NAMES: dict = {}  # autograd node class -> its name()
_MAX_SOURCES = 64  # activation inputs remembered for recomputing their outputs (newest kept)
_next_sequence_nr = torch._C._autograd._get_sequence_nr  # number the next autograd node gets
_thread_id = threading.get_ident


def _node_name(node) -> str:
    """node.name(), cached per node class (one class per kind of autograd node)."""
    name = _NODE_NAMES.get(type(node))
    if name is None:
        name = _NODE_NAMES[type(node)] = node.name()
    return name


class _Recomputer:
    """`_note_source` and `_recompute_region`; needs `_sources` and `_stats` of the context."""

    def _note_source(self, handle: _Handle, ptr: int) -> None:
        """The activation op being run saved its input compressed as `handle`: remember it under
        the op's node, in case a later op saves the op's output."""
        sources = self._sources
        if len(sources) >= _MAX_SOURCES:
            del sources[next(iter(sources))]
        sources[(_thread_id(), _next_sequence_nr() - 1)] = (weakref.ref(handle), ptr)

    def _recompute_region(
        self, ptr: int, x: torch.Tensor, storage, start: int, stop: int
    ) -> _Recomputed | None:
        """A region that recomputes x in backward, if x is (a reshape of) the whole output of an
        activation function whose contiguous input was saved compressed."""
        node, thread = x.grad_fn, _thread_id()  # (sequence numbers count per thread)
        for _ in range(3):  # the next linear saves a view of the output (its rows flattened)
            entry = self._sources.get((thread, node._sequence_nr()))
            if entry is not None:
                break
            nexts = node.next_functions if _node_name(node) in _RESHAPE_NODES else ()
            if len(nexts) != 1 or nexts[0][0] is None:
                return None
            node = nexts[0][0]
        else:
            return None
        source = entry[0]()
        recipe = RECOMPUTABLE.get(_node_name(node))
        if recipe is None or source is None or entry[1] == ptr or not x.is_contiguous():
            return None  # (an in-place activation writes into its input's storage)
        shape = source.shape
        stride = _contiguous_strides(shape)
        if source.stride != stride or x.numel() != math.prod(shape):
            return None
        del self._sources[(thread, node._sequence_nr())]
        func, kwargs = recipe(node)
        region = _Recomputed(
            storage, start, stop, x.dtype, x.device, x._version, func, kwargs, source, shape, stride
        )
        self._stats.recomputed += 1
        self._stats.bytes_recomputed += (stop - start) * x.element_size()
        return region
