"""Let inductor fuse a per-group pack into the pointwise kernel that reads the same tensor.

A saved matmul output h (GPT's MLP input to GELU, Llama's gate and up projections) is read twice
in the forward: by the pack that CompiledActivations appends (a reduction over groups of G
elements: iteration space (rows * groups, G)) and by the pointwise chain the model applies to it
(GELU, SiLU * up: iteration space (rows * cols,), merged into one loop). Inductor fuses two
kernels only if they share a memory access with the same index, and these two index h
differently, so h is read from memory twice (its pack a standalone pass, about a tenth of an MLP's
forward time). Torch 2.13's loop reindexing after fusion handles this; earlier versions do not.

The fix here is a graph edit with no numerical effect: where that chain ends in a tensor a matmul
or attention op reads, its value y is passed on as `where(scale_byte >= 0, y, 0)` computed in the
pack's (rows, groups, G) layout. The condition is always true (the bytes are uint8), so the values
are y's, bit for bit; but the node inductor realizes for the matmul now reads one byte per group,
which keeps its loops split as (rows * groups, G), so its reads of h index h as the pack does,
and inductor fuses pack and chain into one pass over h (for Llama, both packs and SiLU * up).

Only chain ends that inductor realizes anyway are edited: pointwise results that a matmul or an
attention op reads and that are not saved for backward, computed elementwise from tensors of h's
size (not from a norm's statistics, whose row reduction wants a loop split of its own), dense,
with h's (rows, cols) in memory order and a row length that is a whole number of groups. Anything
else stays as it was. (A chain end whose elements do not line up with h's in memory, say through
a transpose, would still get y's values: the guard can only cost fusion, never change a result.)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from coatstate.activations import aten_ops as ops
from coatstate.activations.graph import inline, memory_order

_SEARCH_LIMIT = 64  # nodes visited from one packed tensor: a pointwise chain, not the whole graph


def guard_consumers(
    graph: fx.Graph,
    packed: fx.Node,
    scales: fx.Node,
    perm: tuple[int, ...],
    group_size: int,
    skip: set[fx.Node],
    keep_as_is: set[fx.Node],
) -> int:
    """Route the chain ends computed from `packed` through its scale bytes (module docstring).
    `skip`: nodes not to follow or edit (the packs' nodes; guards made here are added to it);
    `keep_as_is`: nodes that must keep their users (the forward's saved tensors and outputs).
    Returns how many chain ends were edited."""
    val = packed.meta["val"]
    layout = _layout(val, perm)
    if layout is None or layout[1] % group_size:
        return 0
    edited = 0
    for end in _chain_ends(packed, skip):
        end_val = end.meta["val"]
        if end in keep_as_is or end_val.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            continue
        end_perm = memory_order(end_val)
        if _layout(end_val, end_perm) != layout:
            continue
        users = [u for u in end.users if u.op != "output"]
        before = set(graph.nodes)
        guard = _guard_function(end_perm, layout[1], group_size, end_val)
        with graph.inserting_before(end.next):  # (inserting_after would reverse the nodes)
            (guarded,) = inline(graph, guard, [end, scales])
        skip |= set(graph.nodes) - before
        for user in users:
            user.replace_input_with(end, guarded)
        edited += 1
    return edited


def _layout(val: torch.Tensor, perm: tuple[int, ...]) -> tuple[int, int] | None:
    """(rows, cols) of val walked in `perm` order if that walk is dense, else None."""
    if val.dim() == 0 or any(not isinstance(s, int) for s in (*val.shape, *val.stride())):
        return None
    permuted = val.permute(perm)
    if not permuted.is_contiguous():
        return None
    cols = permuted.shape[-1]
    return (val.numel() // cols if cols else 0, cols)


def _chain_ends(start: fx.Node, skip: set[fx.Node]) -> list[fx.Node]:
    """Pointwise (not view) nodes computed from `start` through pointwise ops and views that a
    matmul or attention op reads, directly or through views."""
    ends, seen, frontier = [], {start}, [start]
    while frontier and len(seen) < _SEARCH_LIMIT:
        node = frontier.pop()
        for user in node.users:
            if user in seen or user in skip or user.op != "call_function" or not ops.is_pointwise(user):
                continue
            seen.add(user)
            frontier.append(user)
            if not ops.is_view(user) and _read_by_extern_op(user) and _elementwise(user, start):
                ends.append(user)
    return ends


def _elementwise(end: fx.Node, start: fx.Node) -> bool:
    """Every tensor the pointwise chain ending at `end` reads has start's numel: no broadcast
    operand such as a norm's statistics, whose reduction wants a loop split of its own."""
    numel = start.meta["val"].numel()
    seen, frontier = set(), [end]
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        if len(seen) > _SEARCH_LIMIT:
            return False
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.numel() != numel:
            return False
        if node is not start and node.op == "call_function" and ops.is_pointwise(node):
            frontier.extend(node.all_input_nodes)
    return True


def _read_by_extern_op(node: fx.Node, depth: int = 4) -> bool:
    for user in node.users:
        if user.op != "call_function":
            continue
        if user.target in ops.MATMULS or user.target in ops.ATTENTION:
            return True
        if ops.is_view(user) and depth > 0 and _read_by_extern_op(user, depth - 1):
            return True
    return False


def _guard_function(perm: tuple[int, ...], cols: int, group_size: int, val: torch.Tensor):
    inverse = tuple(sorted(range(len(perm)), key=perm.__getitem__))
    shape = tuple(val.permute(perm).shape)
    groups = cols // group_size

    def guard(y, scales):
        y3 = y.permute(perm).reshape(-1, groups, group_size)
        keep = (scales.reshape(-1, groups) >= 0).unsqueeze(-1)  # (always true: uint8 bytes)
        return (torch.where(keep, y3, 0).reshape(shape).permute(inverse),)

    return guard
