"""Saved views that are all the pieces of one split buffer, packed as that buffer (for compiled.py).

GPT's attention saves q, k and v, three views of one qkv projection split along its last dim.
Packing the buffer once reads it in one pass and decodes it in one kernel, and backward views
the decoded buffer again through the same chain of nodes. That is right for any pure view chain;
the conditions here make the bytes those of packing each piece on its own too: the pieces are all
of one split's (so they tile the buffer, none overlaps another or is left out), and a split along
the last dim cuts it at multiples of the group size (so no group of 16 spans two pieces).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from coatstate.activations import aten_ops as ops

_RESHAPES = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
                       torch.ops.aten.reshape.default})  # fmt: skip


def view_chain(node: fx.Node, root: fx.Node) -> list[fx.Node] | None:
    """The nodes (in order, node last) that make node a view of root through views and split pieces
    (no dtype casts); [] for root itself, None if node is not such a view."""
    chain = []
    while node is not root:
        if node.op != "call_function":
            return None
        chain.append(node)
        if node.target is operator.getitem and getattr(node.args[0], "target", None) in ops.SPLITS:
            chain.append(node.args[0])
            node = node.args[0].args[0]
        elif ops.is_view(node):
            node = node.args[0]
        else:
            return None
    return chain[::-1]


def pieces_of_one_split(root: fx.Node, nodes: list[fx.Node], group_size: int) -> bool:
    """Each node is a view of a different piece of one split of root (or of a reshape of it),
    one node per piece; along the last dim, every piece is a multiple of group_size wide."""
    splits, pieces = set(), set()
    for node in nodes:
        chain = view_chain(node, root)
        at = [i for i, n in enumerate(chain or []) if n.target in ops.SPLITS]
        if len(at) != 1 or any(n.target not in _RESHAPES for n in chain[: at[0]]):
            return False
        splits.add(chain[at[0]])
        pieces.add(chain[at[0] + 1].args[1])  # (the getitem that follows a split in the chain)
    if len(splits) != 1:
        return False
    split = splits.pop()
    parts, source = split.meta.get("val"), split.args[0].meta["val"]
    if not isinstance(parts, (list, tuple)) or len(pieces) != len(nodes) or len(parts) != len(nodes):
        return False
    dim_at = 1 if split.target is torch.ops.aten.unbind.int else 2
    dim = split.args[dim_at] if len(split.args) > dim_at else split.kwargs.get("dim", 0)
    if dim % source.dim() != source.dim() - 1:
        return True  # (pieces of whole rows: a row's groups lie in one piece)
    return split.target is not torch.ops.aten.unbind.int and all(p.shape[-1] % group_size == 0 for p in parts)


def pinning_views(held: dict[int, fx.Node], movable: set[int], root_of, min_numel: int) -> set[int]:
    """Positions (of `movable`, among the saved tensors `held` until backward as they are) of views
    that pin a larger buffer: one that nothing else held is a view of or is, with at least
    `min_numel` of its elements in no held view. Llama's v is one: a view of the qkv projection
    whose q and k are rotated into new tensors, it keeps the whole projection alive until backward,
    where a compact copy of v holds its own elements only. `root_of(node)` is the buffer a node
    views (the node itself if it is no view)."""
    by_root: dict[fx.Node, list[int]] = {}
    for i, node in held.items():
        by_root.setdefault(root_of(node), []).append(i)
    found = set()
    for root, members in by_root.items():
        val = root.meta.get("val")
        pinned_anyway = any(i not in movable for i in members)
        if root.op != "call_function" or not isinstance(val, torch.Tensor) or pinned_anyway:
            continue  # (a graph input is held by its caller; an unmovable view pins the buffer anyway)
        used = sum(held[i].meta["val"].numel() for i in members)
        if val.numel() - used >= max(min_numel, 1):
            found.update(members)
    return found
