"""Saved activations in FP8 INSIDE torch.compile'd graphs: quantization fused into the model's kernels.

    fp8_saves = coatstate.CompiledActivations()           # COAT's policy, as compress_activations
    for block in model.blocks:
        block.compile(options=fp8_saves.options)          # or torch.compile(m, options=...)
    loss = model(x); loss.backward()
    print(fp8_saves.stats.summary())                      # per compiled graph, at compile time

Why a second path: compress_activations works on any model through saved-tensor hooks, which run
Python per saved tensor (benchmarks/experiments/activation_host.py measures it). A transformer's forward is
often host-bound, so that Python time is step time. Here nothing runs per step: inductor's
partitioner splits the joint graph into forward and backward, and this partitioner (inductor's
`custom_partitioner_fn` hook) rewrites the boundary. Each floating-point tensor the forward saves
for backward is replaced by its FP8 codes and scale bytes, computed by nodes appended to the
forward graph (inductor fuses them into the kernel that produces the tensor, or into one pass over
it), and the backward graph decodes them right before their first use. The codec is
coatstate.formats.activation's pure-torch one, traced: the bytes held are exactly
compress_activations' (docs/FORMAT.md, "Saved activations").

The op kind comes from the graph, not the Python call site: a saved tensor that feeds a matmul
is a linear input, one that feeds a mean/var_mean (directly or through one pointwise op, such as
the residual add) is a norm input, attention's q/k/v/out are arguments or outputs of an SDPA op,
one that feeds a gather/nll_loss is the loss's log-probabilities, one that feeds erf/tanh/sigmoid
an activation input, and the policy (ActivationPolicy: the same fields and defaults as
compress_activations) picks the granularity. Views of one buffer (q, k, v split from one qkv
projection) share the granularity of the first one packed, as compress_activations' regions do.

Recomputed in backward instead of saved (`policy.recompute`, on by default): tensors that views,
casts and pointwise ops make from other saved tensors and parameters, such as a norm's output
(from its held input and statistics: the next linear's input), the MLP's hidden activation (from
the held GELU/SiLU inputs) and autocast's bf16 copies of the weights (from the parameters, alive
anyway; always recomputed, they are not activations). The held inputs decide the error, as for
compress_activations' recomputed activation outputs.

Never compressed (each counted in `stats.kept_reasons`, each listed in `report`): parameters;
graph inputs that need no gradient (data the caller holds; a block's input activation, which
needs one, is held by its kind: that is what compiling per block saves); tensors the graph also
returns; non-float and small tensors; statistics of reductions (a norm's mean and rstd);
expanded (stride-0) views; tensors with a dynamic (symbolic) shape. A graph whose backward inputs
do not line up with its forward's saved tensors is left as partitioned, with a warning. A kept
tensor that is a view of a larger buffer no other saved tensor holds (Llama's v, once q and k are
rotated into new tensors, is the qkv projection's last third) is kept as a compact copy, so that
the rest of the buffer is freed after forward (shared_buffers.pinning_views).
"""

from __future__ import annotations

import dataclasses
import operator
import warnings

import torch
import torch.fx as fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files  # (torch >= 2.9)

from coatstate.activations import aten_ops as ops
from coatstate.activations import consumer_fusion, shared_buffers
from coatstate.activations import graph as graph_edits
from coatstate.activations import policy as policy_module
from coatstate.activations import stats as stats_module
from coatstate.activations.consumer_fusion import guard_consumers
from coatstate.activations.graph import Boundary, LayoutError, copy_nodes, inline, is_tensor, memory_order
from coatstate.activations.op_kinds import OpKind
from coatstate.activations.policy import ActivationPolicy, Granularity
from coatstate.activations.shared_buffers import pieces_of_one_split, pinning_views, view_chain
from coatstate.activations.stats import ActivationStats, KeepReason
from coatstate.formats import activation as codec
from coatstate.formats import fp8 as fp8_format
from coatstate.formats.fp8 import FLOAT_DTYPES

__all__ = ["CompiledActivations"]

_KEY_MODULES = (ops, consumer_fusion, graph_edits, policy_module, shared_buffers, stats_module)
_KEY_FILES = (__file__, *(m.__file__ for m in (*_KEY_MODULES, codec, fp8_format)))  # (they shape the graphs)


class CompiledActivations(CustomPartitionerFn):
    """A torch.compile (inductor) partitioner that holds saved activations in FP8 inside the graphs.

    Pass its `options` to torch.compile: each floating-point tensor a compiled forward saves for
    backward is replaced by FP8 codes and scales that inductor computes in the producing kernel,
    decoded in the backward graph (the module docstring says how).

    Args:
        policy (`ActivationPolicy`, *optional*): keyword arguments override its fields, as for
            compress_activations (`backend`, `compiled` and `compiled_fp32` do not apply:
            inductor does the work and the op kinds are known; `recompute=False` saves what
            would be recomputed, except parameter casts).
        cache: let inductor's on-disk caches serve graphs compiled before with the same policy.
            Off by default: on a cache hit the partitioner does not run, so `stats` and `report`
            would not describe that graph (its compiled code is right either way).
        cudagraphs: run the compiled graphs as CUDA graphs (cudagraph trees, what
            torch.compile(mode="reduce-overhead") sets; `mode` and `options` cannot both be
            passed): a block's forward or backward then costs the host one graph launch instead
            of one per kernel. The FP8 codes and scales are ordinary outputs of the forward graph
            and inputs of the backward one, made and read by the graphs' own kernels with no host
            sync or CPU state between them, so they live in the graphs' memory pool like any
            other saved tensor. Call torch.compiler.cudagraph_mark_step_begin() before each
            training step and let `.grad` be None (zero_grad's default) or allocated before the
            first compiled backward (cudagraph trees' rule for gradients). Ignored off CUDA.
        fuse_consumers: let inductor fuse a per-group pack into the pointwise kernel (GELU,
            SiLU * up) that reads the same matmul output, instead of a second pass over it
            (activations/consumer_fusion.py; no numerical effect). Off only to measure it.
        **overrides: fields of the policy to replace, e.g. `attention="keep"`.

    Returns:
        `CompiledActivations`: `options` (the dict for torch.compile), `stats` (`ActivationStats`,
        accumulated over every graph partitioned with it: one per distinct compiled block, at
        compile time, not per step), `graphs` (how many) and `report` (what each saved tensor
        became).

    Raises:
        TypeError: an unknown override or a `policy` that is not an ActivationPolicy.
        ValueError: an invalid policy value.

    Example:
        >>> fp8_saves = coatstate.CompiledActivations()
        >>> for block in model.blocks:
        ...     block.compile(options=fp8_saves.options)
        >>> model(x).loss.backward()
        >>> print(fp8_saves.stats.summary())
    """

    def __init__(
        self,
        policy: ActivationPolicy | None = None,
        *,
        cache: bool = False,
        cudagraphs: bool = False,
        fuse_consumers: bool = True,
        **overrides,
    ) -> None:
        self.policy = ActivationPolicy.resolve(policy, overrides)
        self.cache = bool(cache)
        self.cudagraphs = bool(cudagraphs)
        self.fuse_consumers = bool(fuse_consumers)
        self.consumers_fused = 0
        """Pointwise chains that read a per-group packed tensor, routed so that inductor fuses
        the pack into their kernel (consumer_fusion; counted at compile time)."""
        self.buffers_shared = 0
        """Buffers packed once for the saved views that tile them (q, k, v of one qkv projection)."""
        self.stats = ActivationStats()
        self.graphs = 0
        """Forward/backward pairs partitioned (blocks of one class usually share one graph)."""
        self.report: list[tuple[str, tuple, torch.dtype, str]] = []
        """(graph node, shape, dtype, what it became) for every tensor a compiled forward saved."""

    def __deepcopy__(self, memo) -> CompiledActivations:
        return self  # inductor copies its config (repro strings, caches): stats must stay on one object

    @property
    def options(self) -> dict:
        """torch.compile's `options` that install this partitioner (and, unless `cache`, turn
        inductor's caches off for those compiles; with `cudagraphs`, turn CUDA graphs on)."""
        options = {"custom_partitioner_fn": self}
        if not self.cache:
            options["fx_graph_cache"] = False
        if self.cudagraphs:
            options["triton.cudagraphs"] = True  # (inductor skips it, with a log line, off CUDA)
        return options

    def uuid(self):
        """Inductor's cache key: the files that shape the rewritten graphs (this one, the graph
        editing, the op sets, the codec it traces) and the options. (Never None: inductor would
        then key the graph as if no partitioner were installed.)"""
        return (get_hash_for_files(_KEY_FILES), repr(self.policy), self.fuse_consumers)

    def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs) -> tuple[fx.GraphModule, fx.GraphModule]:
        kwargs.setdefault("compiler", "inductor")
        needs_grad = _inputs_needing_grad(gm, kwargs["num_fwd_outputs"])
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        self.graphs += 1
        try:
            rewrite = _Rewrite(self, fw, bw, kwargs, needs_grad)
        except LayoutError as e:  # raised before any edit: the graphs run as partitioned
            msg = f"CompiledActivations left a compiled graph's saved tensors as they are: {e}"
            warnings.warn(msg, stacklevel=2)
            self.stats.kept_reasons[KeepReason.LAYOUT_NOT_RECOGNISED] += 1
            return fw, bw
        rewrite.run()
        return fw, bw


@dataclasses.dataclass
class _Pack:
    node: fx.Node  # the forward's node (a saved tensor)
    position: int  # its position in the forward's outputs
    granularity: Granularity
    label: str  # stats key: op kind, or attention_v_out
    perm: tuple[int, ...]  # dims in memory order (by stride): packed as x.permute(perm)
    members: list[_Pack] = dataclasses.field(default_factory=list)
    """If not empty, `node` is the dense buffer that these saved views (q, k, v) tile, packed once."""


@dataclasses.dataclass
class _Recompute:  # (keyed by its position in the forward's outputs)
    node: fx.Node
    nodes: list[fx.Node]  # the forward nodes that compute it, in order
    leaves: set[fx.Node]  # what they read: saved tensors and parameters
    from_parameter: bool  # a view/cast of a parameter (not activation bytes)


_FROM_PARAMETER = KeepReason.PARAMETER_CAST


class _Rewrite:
    """One forward/backward pair: decide what becomes of each saved tensor, then edit the graphs."""

    def __init__(self, owner: CompiledActivations, fw, bw, kwargs, needs_grad: set[str]) -> None:
        self.owner, self.policy, self.stats, self.report = owner, owner.policy, owner.stats, owner.report
        self.boundary = Boundary(fw, bw, kwargs["num_fwd_outputs"])
        placeholders = fw.graph.find_nodes(op="placeholder")
        static = kwargs.get("static_lifetime_input_indices")
        if static is None:  # unknown: every input might be a parameter (keeps more, never loses)
            self.parameters = set(placeholders)
        else:
            self.parameters = {placeholders[i] for i in static if i < len(placeholders)}
        self.needs_grad = {p for p in placeholders if p.name in needs_grad}

    # -- what becomes of each saved tensor -----------------------------------------------
    def run(self) -> None:
        b = self.boundary
        returned = set(b.outputs[: b.first_saved])
        decided = {
            i: self._decide(b.outputs[i], b.outputs[i].meta["val"], returned)
            for i in b.positions()
            if is_tensor(b.outputs[i])  # (not a SymInt or opaque object saved for backward)
        }
        self._share_buffers(decided)
        recompute = self._recomputable(decided)
        held = {i: b.outputs[i] for i, d in decided.items() if isinstance(d, str) and i not in recompute}
        held.update((i, n) for i, n in enumerate(b.outputs[: b.first_saved]) if is_tensor(n))  # (returned)
        movable = {i for i in held if i >= b.first_saved and decided[i].startswith("policy keeps")}
        compact = pinning_views(held, movable, lambda n: _view_root(n, casts=False)[0], self.policy.min_numel)
        packs = []
        for i, decision in decided.items():
            node = b.outputs[i]
            val = node.meta["val"]
            shape = tuple(s if isinstance(s, int) else str(s) for s in val.shape)  # (SymInts as text)
            if i in compact:  # held as it is, copied out of the buffer it would pin
                self._keep(val, decision)
                packs.append(_Pack(node, i, Granularity.KEEP, decision, perm=memory_order(val)))
                self.report.append((node.name, shape, val.dtype, f"kept: {decision} (a compact copy)"))
            elif i in recompute:
                what = (
                    "from its parameter"
                    if recompute[i].from_parameter
                    else "from " + ", ".join(sorted(n.name for n in recompute[i].leaves))
                )
                self.report.append((node.name, shape, val.dtype, f"recomputed in backward {what}"))
            elif isinstance(decision, str):
                self._keep(val, decision)
                self.report.append((node.name, shape, val.dtype, f"kept: {decision}"))
            else:
                packs.append(_Pack(node, i, *decision, perm=memory_order(val)))
                self.report.append((node.name, shape, val.dtype, f"{decision[1]}/{decision[0].value}"))
        if packs or recompute:
            self._edit(self._merge_shared(packs), recompute)

    def _merge_shared(self, packs: list[_Pack]) -> list[_Pack]:
        """Saved per-group views that are all the pieces of one split of a dense buffer (q, k and
        v of one qkv projection) become one pack of that buffer, decoded once in backward and
        viewed again: one pass over the buffer each way instead of one per view, as
        compress_activations packs a shared storage once. Pieces split along the last dim must be
        a whole number of groups wide, so that the buffer's groups are the pieces' own."""
        by_root: dict[fx.Node, list[_Pack]] = {}
        for p in packs:
            if p.granularity is Granularity.GROUP:
                by_root.setdefault(_view_root(p.node, casts=False)[0], []).append(p)
        saved = set(self.boundary.outputs)
        merged = {}
        for root, members in by_root.items():
            val = root.meta.get("val")
            if (
                len(members) < 2
                or root in saved
                or root in self.parameters
                or not isinstance(val, torch.Tensor)
                or not val.is_contiguous()
                or val.dtype != members[0].node.meta["val"].dtype
                or val.numel() != sum(m.node.meta["val"].numel() for m in members)
                or not pieces_of_one_split(root, [m.node for m in members], self.policy.group_size)
            ):
                continue
            perm = tuple(range(val.dim()))
            merged[root] = _Pack(root, -1, Granularity.GROUP, members[0].label, perm, members=members)
        inside = {id(m) for p in merged.values() for m in p.members}
        self.owner.buffers_shared += len(merged)
        return [p for p in packs if id(p) not in inside] + list(merged.values())

    def _keep(self, val: torch.Tensor, reason: str) -> None:
        self.stats.kept += 1
        self.stats.kept_reasons[reason] += 1
        nbytes = val.numel() * val.element_size()
        self.stats.bytes_kept[reason] += nbytes if isinstance(nbytes, int) else 0  # (symbolic: unknown)

    def _decide(self, node: fx.Node, val: torch.Tensor, returned: set):
        """A reason to keep the tensor (str), or (granularity, label)."""
        if val.dtype not in FLOAT_DTYPES:
            return KeepReason.NOT_FLOAT
        if any(not isinstance(s, int) for s in (*val.shape, *val.stride())):
            return "dynamic (symbolic) shape in a compiled graph"
        root, cast = _view_root(node)
        if root.op == "placeholder" and root in self.parameters:  # (alive anyway)
            return KeepReason.LEAF if node is root else _FROM_PARAMETER
        if val.numel() < max(self.policy.min_numel, 1):
            return KeepReason.small(self.policy.min_numel)
        if any(st == 0 and n > 1 for n, st in zip(val.shape, val.stride(), strict=True)):
            return "expanded (stride-0) view"
        if node in returned:
            return KeepReason.GRAPH_OUTPUT
        if _is_statistic(node):
            return "statistics of a reduction (a norm's mean/rstd)"
        if root.op == "placeholder" and not cast and root not in self.needs_grad:
            return KeepReason.GRAPH_INPUT  # data the caller holds; an activation needs grad
        label, granularity = self._kind(node)
        if granularity is Granularity.BF16 and val.dtype is not torch.float32:
            granularity = Granularity.KEEP  # already 16-bit: bfloat16 would save nothing
        if granularity is Granularity.KEEP:
            return KeepReason.by_policy(label)
        return granularity, label

    def _share_buffers(self, decided: dict) -> None:
        """Views of one buffer (q, k and v split from one qkv projection) free its memory only if
        all are packed: one the policy keeps takes the granularity of one that is packed, as
        compress_activations' first save decides for a shared storage."""
        b = self.boundary
        packed = {}
        for i, decision in decided.items():
            if not isinstance(decision, str):
                packed.setdefault(_view_root(b.outputs[i], casts=False)[0], decision[0])
        for i, decision in decided.items():
            if isinstance(decision, str) and decision.startswith("policy keeps"):
                shared = packed.get(_view_root(b.outputs[i], casts=False)[0])
                if shared is not None:
                    decided[i] = (shared, decision.removeprefix("policy keeps "))

    def _recomputable(self, decided: dict) -> dict[int, _Recompute]:
        """Saved tensors the backward recomputes instead: views/casts of parameters, and large
        tensors that pointwise ops compute from other saved tensors and parameters (GELU's
        output from its held input, a norm's output from its input and statistics), as
        compress_activations recomputes activation outputs. The input still held decides the error."""
        b = self.boundary
        out = {}
        for i, decision in decided.items():
            node = b.outputs[i]
            found = _pointwise_closure(node, self.parameters) if decision == _FROM_PARAMETER else None
            if found is not None:  # (views and casts of a parameter: always found)
                out[i] = _Recompute(node, *found, from_parameter=True)
        if not self.policy.recompute:
            return out
        saved = {b.outputs[i] for i in decided if i not in out}
        in_use = set()  # leaves of recomputed tensors stay saved
        for i, decision in decided.items():
            node = b.outputs[i]
            candidate = not isinstance(decision, str) or decision.startswith("policy keeps")
            if i in out or not candidate or node in in_use:
                continue
            found = _pointwise_closure(node, (saved - {node}) | self.parameters)
            if found is not None and found[1] - self.parameters:
                out[i] = _Recompute(node, *found, from_parameter=False)
                saved.discard(node)
                in_use |= found[1]
        return out

    def _kind(self, node: fx.Node) -> tuple[str, Granularity]:
        policy = self.policy
        if node.target is operator.getitem and getattr(node.args[0], "target", None) in ops.ATTENTION:
            if node.args[1] == 0:  # the attention op's output; its other outputs are statistics
                return "attention_v_out", policy.attention_v_out
            return KeepReason.ATTENTION_STATISTICS, Granularity.KEEP
        users = _users_through_views(node)
        for user, arg in users:
            if user.target in ops.ATTENTION:
                if arg in (0, 1):
                    return OpKind.ATTENTION.value, policy.attention
                return "attention_v_out", policy.attention_v_out
        targets = {user.target for user, _ in users}
        if targets & ops.LOSSES:
            return OpKind.LOSS.value, policy.loss
        if targets & ops.MATMULS:
            return OpKind.LINEAR.value, policy.linear
        steps = [user for user, _ in users if user.target in ops.POINTWISE_TO_REDUCTION]
        second = {u.target for user in steps for u in user.users}
        if (targets | second) & ops.NORM_REDUCTIONS:
            return OpKind.NORM.value, policy.norm
        if (targets | second) & ops.ACTIVATIONS or _feeds(node, ops.ACTIVATIONS, depth=3):
            return OpKind.ACTIVATION.value, policy.activation
        return OpKind.OTHER.value, policy.other

    # -- graph surgery -------------------------------------------------------------------
    def _edit(self, packs: list[_Pack], recompute: dict[int, _Recompute]) -> None:
        b = self.boundary
        fw_graph, bw_graph = b.fw.graph, b.bw.graph
        jobs = []  # (packed forward node, unpack, its backward arguments, the saved tensors it stands for)
        group_packs, pack_nodes = [], set()  # (_Pack, its scale bytes); every node the packs added
        for p in packs:
            x = p.node
            pack, unpack = _codec_functions(p, self.policy, x.meta["val"])
            before = set(fw_graph.nodes)
            with fw_graph.inserting_before(x.next):  # (inserting_after would reverse the nodes)
                packed = inline(fw_graph, pack, [x])
            pack_nodes |= set(fw_graph.nodes) - before
            if p.granularity is Granularity.GROUP:
                group_packs.append((p, packed[1]))
            if p.granularity is not Granularity.KEEP:  # (a compact copy was counted as kept)
                self._count(p, x.meta["val"], packed)
            members = []  # (saved node, its backward input, that input's users, views from x to it)
            for k, m in enumerate(p.members or [p]):
                placeholder = b.input_of(m.node)
                members.append((m.node, placeholder, list(placeholder.users), view_chain(m.node, x)))
                if k == 0:
                    b.replace(m.position, packed[0])  # it receives the codes now
                else:
                    b.remove(m.position)  # (its users read a view of the decoded buffer)
            args = [members[0][1]] + [b.add(scale, f"{x.name}_fp8_scale") for scale in packed[1:]]
            jobs.append((x, unpack, args, members))
        removed = {i: b.remove(i) for i in recompute}
        readers = {}  # saved node -> users of the removed inputs recomputed from it
        for i, r in recompute.items():
            for leaf in r.leaves:
                readers.setdefault(leaf, []).extend(removed[i].users)
        values = {}  # forward node -> its value in the backward
        for x, unpack, args, members in jobs:  # decoded right before the first read
            first = b.first([u for m, _, users, _ in members for u in users + readers.get(m, [])])
            if first is None:
                continue
            with bw_graph.inserting_before(first):
                (decoded,) = inline(bw_graph, unpack, args)
                for m, _, _, chain in members:
                    values[m] = copy_nodes(bw_graph, chain, {x: decoded}) if chain else decoded
            for m, placeholder, users, _ in members:
                for user in users:
                    user.replace_input_with(placeholder, values[m])
        for i, r in recompute.items():
            users = list(removed[i].users)
            first = b.first(users)
            if first is None:
                continue
            env = {leaf: values.get(leaf) or b.input_of(leaf) or b.add(leaf, leaf.name) for leaf in r.leaves}
            with bw_graph.inserting_before(first):
                value = copy_nodes(bw_graph, r.nodes, env)
            for user in users:
                user.replace_input_with(removed[i], value)
            if not r.from_parameter:
                val = r.node.meta["val"]
                self.stats.recomputed += 1
                self.stats.bytes_recomputed += val.numel() * val.element_size()
        if self.owner.fuse_consumers:
            self._fuse_into_consumers(group_packs, pack_nodes)
        b.finish()

    def _fuse_into_consumers(self, group_packs: list, pack_nodes: set) -> None:
        """consumer_fusion.guard_consumers for every per-group pack, after all edits of the
        saved tensors (so that a tensor no longer saved, now recomputed, may be a chain end)."""
        b = self.boundary
        saved = {n for i, n in enumerate(b.outputs) if i not in b.removed} | set(b.extra)
        for p, scales in group_packs:
            self.owner.consumers_fused += guard_consumers(
                b.fw.graph, p.node, scales, p.perm, self.policy.group_size, pack_nodes, saved
            )

    def _count(self, p: _Pack, val: torch.Tensor, packed: list) -> None:
        stats = self.stats
        for m in p.members or [p]:  # (a shared buffer counts as the saves it stands for)
            v = m.node.meta["val"]
            stats.packed += 1
            stats.packed_by_kind[f"{m.label}/{m.granularity.value}"] += 1
            stats.bytes_original += v.numel() * v.element_size()
        stats.bytes_packed += sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in packed)


def _inputs_needing_grad(joint: fx.GraphModule, num_fwd_outputs: int) -> set[str]:
    """Names of the primal inputs the joint graph computes a gradient for (its outputs after the
    forward's are one gradient or None per primal, in order)."""
    primals = [n for n in joint.graph.find_nodes(op="placeholder") if n.name.startswith("primals")]
    grads = list(joint.graph.find_nodes(op="output")[0].args[0])[num_fwd_outputs:]
    return {p.name for p, g in zip(primals, grads, strict=False) if g is not None}


def _pointwise_closure(node: fx.Node, leaves: set, limit: int = 48):
    """(nodes in order, leaves read) if node is computed from `leaves` by views, dtype casts and
    pointwise ops only (at most `limit` of them), else None."""
    order, seen, used = [], set(), set()

    def visit(n) -> bool:
        if n in leaves and n is not node:
            used.add(n)
            return True
        if n in seen:
            return True
        if n.op != "call_function" or not ops.is_pointwise(n) or len(seen) >= limit:
            return False
        seen.add(n)
        if not all(visit(a) for a in n.all_input_nodes):
            return False
        order.append(n)  # (after its inputs: a topological order)
        return True

    return (order, used) if visit(node) and used else None


def _view_root(node: fx.Node, casts: bool = True) -> tuple[fx.Node, bool]:
    """(the node a chain of views (and dtype casts if `casts`) starts from, whether it has a cast)."""
    cast = False
    while node.op == "call_function":
        if node.target is operator.getitem and getattr(node.args[0], "target", None) in ops.SPLITS:
            node = node.args[0].args[0]  # one piece of a split: a view of the split tensor
            continue
        if node.target not in ops.VIEWS:
            break
        is_cast = node.target is torch.ops.prims.convert_element_type.default
        if is_cast and not casts:
            break
        cast |= is_cast
        node = node.args[0]
    return node, cast


def _is_statistic(node: fx.Node, depth: int = 3) -> bool:
    """node is a reduction's result, directly or through a few pointwise steps (rsqrt(var + eps))."""
    for _ in range(depth + 1):
        if node.op != "call_function":
            return False
        if node.target is operator.getitem:
            node = node.args[0]
        if node.target in ops.REDUCTIONS:
            return True
        if node.target not in ops.STATISTIC_STEPS and node.target not in ops.VIEWS:
            return False
        node = node.args[0]
    return False


def _feeds(node: fx.Node, targets: frozenset, depth: int) -> bool:
    """Some op in `targets` uses node within `depth` steps of its users (an activation's formula).
    Views and dtype casts on the way are not steps: under autocast tanh-GELU's tanh sits behind a
    view and a cast of the matmul output as well as its add and mul."""
    frontier = [node]
    for _ in range(depth):
        users = [u for n in frontier for u in n.users if u.op == "call_function"]
        frontier = []
        while users:
            u = users.pop()
            frontier.append(u)
            if u.target in ops.VIEWS:
                users += [w for w in u.users if w.op == "call_function"]
        if any(u.target in targets for u in frontier):
            return True
    return False


def _users_through_views(node: fx.Node, depth: int = 4) -> list[tuple[fx.Node, int | None]]:
    """(user, index of the argument it is) for the users of node and of its views."""
    found = []
    for user in node.users:
        if user.op != "call_function":
            continue
        if user.target in ops.VIEWS and depth > 0:
            found += _users_through_views(user, depth - 1)
        else:
            arg = next((i for i, a in enumerate(user.args) if a is node), None)
            found.append((user, arg))
    return found


def _codec_functions(saved: _Pack, policy: ActivationPolicy, val: torch.Tensor):
    """(pack, unpack): pack(x) -> codes[, scales]; unpack(codes[, scales]) -> x's values, dtype
    and strides. Traced with make_fx, so plain torch code (the codec itself) is fine."""
    perm, dtype, fmt, group = saved.perm, val.dtype, policy.fmt, policy.group_size
    inverse = tuple(sorted(range(len(perm)), key=perm.__getitem__))
    shape = tuple(val.permute(perm).shape)  # the contiguous layout that is packed
    rows2d = (-1, shape[-1]) if shape else (1, 1)
    granularity = saved.granularity
    if granularity is Granularity.KEEP:  # a compact copy in the same dim order
        return (lambda x: (x.permute(perm).clone(memory_format=torch.contiguous_format),)), (
            lambda c: (c.permute(inverse),)
        )
    if granularity is Granularity.BF16:
        return (lambda x: (x.permute(perm).to(torch.bfloat16),)), (lambda c: (c.to(dtype).permute(inverse),))
    if granularity is Granularity.TENSOR:

        def pack(x):
            return codec.pack_tensor(x.permute(perm), fmt)

        def unpack(codes, scale):
            return (codec.unpack_tensor(codes, scale, dtype).permute(inverse),)

        return pack, unpack

    def pack(x):
        return codec.pack_groups(x.permute(perm).reshape(rows2d), group, fmt)

    def unpack(codes, scales):
        return (codec.unpack_groups(codes, scales, group, dtype).reshape(shape).permute(inverse),)

    return pack, unpack
