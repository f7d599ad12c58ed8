"""Editing the boundary between a partitioned forward and backward graph (for CompiledActivations).

AOTAutograd's partitioner returns a forward graph whose outputs are (user outputs, tensors saved
for backward, SymInts saved for backward) and a backward graph whose inputs are (SymInts, the
saved tensors in the same order and named after the forward's nodes, tangents). `Boundary` keeps
that contract while saved tensors are replaced (codes instead of values), removed (recomputed in
backward instead) or added (scale bytes, parameters to recompute from): extra tensors go at the end
of the saved tensors on both sides, in the same order.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx


def is_tensor(node) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def memory_order(val: torch.Tensor) -> tuple[int, ...]:
    """Dims by decreasing stride: val.permute(p) walks memory in order (contiguous if val is dense;
    a strided slice is packed as a contiguous copy and restored dense in the same dim order)."""
    return tuple(sorted(range(val.dim()), key=lambda d: (-val.stride(d), -val.shape[d])))


class LayoutError(RuntimeError):
    """The partitioned graphs do not have the layout Boundary knows (nothing was edited)."""


class Boundary:
    def __init__(self, fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> None:
        self.fw, self.bw = fw, bw
        self.output = fw.graph.find_nodes(op="output")[0]
        self.outputs = list(self.output.args[0])
        self.first_saved = num_fwd_outputs
        # The i-th saved tensor arrives as the i-th tensor input of the backward (SymInts, which
        # come first there, are not tensors; tangents come after), named after the forward's node.
        saved = [i for i in self.positions() if is_tensor(self.outputs[i])]
        tensors = [p for p in bw.graph.find_nodes(op="placeholder") if is_tensor(p)]
        self.by_position = dict(zip(saved, tensors, strict=False))
        wrong = [
            (self.outputs[i].name, p.name)
            for i, p in self.by_position.items()
            if self.outputs[i].name != p.name
        ]
        if len(tensors) < len(saved) or wrong:
            raise LayoutError(
                f"{len(saved)} saved tensors, {len(tensors)} backward tensor inputs; first mismatch "
                f"(forward node, backward input): {wrong[:1]}"
            )
        self.inputs = {self.outputs[i]: p for i, p in reversed(self.by_position.items())}
        self.anchor = self.by_position[saved[-1]] if saved else None  # (nothing to edit then)
        self.extra: list[fx.Node] = []  # forward nodes added to the saved tensors
        self.removed: set[int] = set()  # positions of saved tensors no longer saved
        self.index = {n: i for i, n in enumerate(bw.graph.nodes)}  # original backward order

    def positions(self) -> range:
        return range(self.first_saved, len(self.outputs))

    def input_of(self, node: fx.Node) -> fx.Node | None:
        """The backward's input that receives the saved forward node."""
        return self.inputs.get(node)

    def replace(self, position: int, node: fx.Node) -> fx.Node:
        """Save `node` in place of the tensor at `position`; returns the backward input, now for it."""
        placeholder = self.by_position[position]
        self.outputs[position] = node
        placeholder.meta = dict(node.meta)
        return placeholder

    def remove(self, position: int) -> fx.Node:
        """Stop saving the tensor at `position`; returns its backward input (erased at finish,
        once its users read a recomputed value instead)."""
        self.removed.add(position)
        return self.by_position[position]

    def add(self, node: fx.Node, name: str) -> fx.Node:
        """Save one more forward node; returns the backward input that receives it."""
        self.extra.append(node)
        with self.bw.graph.inserting_after(self.anchor):
            self.anchor = self.bw.graph.placeholder(name)
        self.anchor.meta = dict(node.meta)
        self.inputs[node] = self.anchor  # (a parameter added once serves every later use)
        return self.anchor

    def first(self, readers: list[fx.Node]) -> fx.Node | None:
        """The earliest of these original backward nodes (where a value they read must exist)."""
        readers = [r for r in readers if r in self.index]
        return min(readers, key=self.index.__getitem__) if readers else None

    def finish(self) -> None:
        removed_inputs = [self.by_position[i] for i in sorted(self.removed)]
        outputs = [n for i, n in enumerate(self.outputs) if i not in self.removed]
        tensors = range(self.first_saved, len(outputs))
        first_sym = next((i for i in tensors if not is_tensor(outputs[i])), len(outputs))
        outputs[first_sym:first_sym] = self.extra
        self.output.update_arg(0, tuple(outputs))
        for placeholder in removed_inputs:
            if placeholder.users:
                raise RuntimeError(f"internal error: {placeholder.name} is still read after removal")
            self.bw.graph.erase_node(placeholder)
        for gm in (self.fw, self.bw):
            gm.graph.lint()
            gm.recompile()


@functools.cache
def _decompositions():
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inline(graph: fx.Graph, fn, args: list[fx.Node]) -> list[fx.Node]:
    """Trace fn (returning a tuple of tensors) on the args' fake values and copy its nodes into
    graph at the insert point; returns the nodes of fn's outputs, each with its fake value."""
    traced = make_fx(fn, decomposition_table=_decompositions())(*[a.meta["val"] for a in args])
    env = dict(zip(traced.graph.find_nodes(op="placeholder"), args, strict=True))
    return list(graph.graph_copy(traced.graph, env))


def copy_nodes(graph: fx.Graph, nodes: list[fx.Node], env: dict) -> fx.Node:
    """Copy forward nodes (in order) into graph at the insert point, reading `env` for the nodes
    they depend on; returns the copy of the last one."""
    env = dict(env)
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    return env[nodes[-1]]
