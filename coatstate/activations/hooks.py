"""compress_activations: tensors autograd saves for backward are held in FP8 until backward.

    with coatstate.compress_activations() as ctx:    # COAT's mixed granularity by default
        loss = model(x)
    loss.backward()
    print(ctx.stats.summary())

For torch.compile'd models, coatstate.CompiledActivations holds the same bytes without hooks: it
rewrites the compiled graphs so that inductor fuses the packing into the model's kernels (no Python per
saved tensor, which matters where a transformer's eager forward is host-bound). This context manager is
the path for eager models.

How it works: a torch.autograd.graph.saved_tensors_hooks pair packs each saved tensor and unpacks it
when backward needs it. The pack hook reads the op kind off the Python call site that is running the op
(coatstate.activations.op_kinds, cached per site), and for ops that say nothing by themselves (a mul)
off the innermost nn.Module.forward on the Python stack, so the policy (coatstate.activations.policy)
can pick the granularity by op kind. Nothing runs per op that saves nothing (no TorchFunctionMode): host
time goes into saved tensors only. On CUDA the Triton kernels of coatstate.kernels.activation do the
work, elsewhere their pure-torch twins in coatstate.formats.activation.

Attention: scaled_dot_product_attention saves q, k and v before its output; which input is which is
known only from the op's autograd node, reachable once the output is saved (its grad_fn). So the inputs
wait (uncompressed, as they are anyway) until the same op saves its output, then q and k are held
first (a qkv storage shared with v takes their granularity: kept by default, ActivationPolicy.attention)
and v after. Backends that save no output of their own (the math fallback) hold every input as
`attention_v_out`.

What is compressed is a REGION of memory, not a tensor: a dense tensor's own bytes, or, for a strided
view such as the q, k and v that split one qkv projection, the whole storage it views (when that storage
is at most 4x the view; otherwise a contiguous copy of the view). Every later save of memory inside a
held region (the same tensor saved by several ops, views, transposes, the k and v next to a q) shares
it: the first save decides the granularity. In backward a region is unpacked once for all the views that
autograd unpacks together (a weak cache).

Recomputed instead of stored: the output of an activation function (GELU, SiLU, ...) whose input the
same call saved compressed, when a later op (the next linear) saves that output: backward applies the
function again to the unpacked input (`ActivationPolicy.recompute`). The output is recognised by its
autograd node (GeluBackward0, ...: _RECOMPUTABLE) and that node's sequence number, which the pack hook
of the input noted.

What is never compressed (each is reported in `stats.kept_reasons`):
- parameters, buffers and views or casts of them; tensors created before the context was entered (the
  model's inputs; told apart by autograd's node sequence numbers); leaves that require grad;
  autocast's casts of parameters: they stay alive anyway (compressing would ADD memory);
- integer/bool/FP8 tensors, tensors below `min_numel`, expanded (stride-0) views;
- tensors whose op kind the policy says to keep (cross_entropy's log-probabilities by default).
A kept tensor is stored detached with its version counter; if it was modified in place before
backward, unpacking raises RuntimeError, as autograd itself would (saved-tensor hooks switch
autograd's own check off). Compressed regions are snapshots taken at save time.

Works with non-reentrant torch.utils.checkpoint (the region's tensors go to checkpoint's own hooks,
which take precedence, and pass through). Around a torch.compile'd call the compiled graph saves its
tensors when its forward returns (AOTAutograd's CompiledFunction.apply), all without grad_fn, so the
eager rules above would keep every one: there the graph's inputs stay (alive anyway), tensors with a
parameter's shape are taken for its autocast cast and kept, and the rest are packed with the policy's
`compiled` granularity (16-bit) or `compiled_fp32` (float32, kept by default); the op kind is not
visible. Compile per block (`block.compile()` for each transformer block), not the whole model: a graph
saves all its tensors when it returns and unpacks them all when its backward starts, so around one
whole-model graph the originals and the packed copies coexist and the peak rises above uncompressed
(docs/benchmarks.md). Entering the context INSIDE a compiled function raises a RuntimeError instead of
silently doing nothing."""

from __future__ import annotations

import functools
import sys
import threading
import warnings
import weakref

import torch

from coatstate.activations.op_kinds import OpKind, kind_of_call_site, kind_on_stack
from coatstate.activations.policy import ActivationPolicy, Granularity
from coatstate.activations.recompute import _NODE_NAMES, _node_name, _Recomputer
from coatstate.activations.regions import (
    _expired,
    _Handle,
    _Kept,
    _KeptRegion,
    _layout,
    _Packed,
    _Pending,
    _Region,
)
from coatstate.activations.stats import ActivationStats, KeepReason
from coatstate.activations.unpack import _Unpacker, kernels
from coatstate.formats import activation as codec
from coatstate.formats.fp8 import FLOAT_DTYPES
from coatstate.kernels.runtime import triton_usable

__all__ = ["compress_activations"]

_VIEW_OR_COPY_NODES = frozenset(
    "TBackward0 ViewBackward0 ToCopyBackward0 TransposeBackward0 PermuteBackward0 ExpandBackward0 "
    "SliceBackward0 SelectBackward0 UnsqueezeBackward0 SqueezeBackward0 SqueezeBackward1 "
    "AsStridedBackward0 UnsafeViewBackward0 ReshapeAliasBackward0 AliasBackward0".split()
)
_CAST_OR_LEAF = _VIEW_OR_COPY_NODES | {"torch::autograd::AccumulateGrad"}  # nodes it does not stop at
_POLICY_KEEPS: dict = {}  # label -> KeepReason.by_policy(label): one f-string per label, not per save
_SLOTS = 4096  # per-tensor scale slots per device buffer (kernel path)
_MAX_STORAGE_PER_VIEW = 4  # a strided view packs its whole storage only up to this many times its size
_next_sequence_nr = torch._C._autograd._get_sequence_nr  # number the next autograd node gets
_is_compiling = torch.compiler.is_compiling
_thread_id = threading.get_ident
_FUNCTION_APPLY = torch.autograd.function.Function.apply.__func__.__code__  # where autograd.Functions save
_AOT_MODULE = "torch._functorch._aot_autograd"  # where torch.compile's CompiledFunction classes live
# Enum members as plain globals: in the hot path `OpKind.OTHER` and `.value` go through Python-level
# descriptors (enum's), a microsecond here and there per saved tensor.
_OTHER, _ATTENTION, _ACTIVATION = OpKind.OTHER, OpKind.ATTENTION, OpKind.ACTIVATION
_KEEP, _TENSOR, _BF16 = Granularity.KEEP, Granularity.TENSOR, Granularity.BF16
_NOT_FLOAT, _LEAF, _NO_GRAD_FN = KeepReason.NOT_FLOAT, KeepReason.LEAF, KeepReason.NO_GRAD_FN
_BEFORE_CONTEXT, _PARAMETER_CAST = KeepReason.BEFORE_CONTEXT, KeepReason.PARAMETER_CAST
_MAX_LOG = 1 << 16  # log entries before they are counted into stats (see compress_activations.stats)


def _policy_keeps(label: str) -> str:
    reason = _POLICY_KEEPS.get(label)
    if reason is None:
        reason = _POLICY_KEEPS[label] = KeepReason.by_policy(label)
    return reason


def _derived_from_parameter(x: torch.Tensor, node=None) -> bool:
    """True if x is a chain of views/dtype casts of a leaf that requires grad (autocast's weights).
    `node`: x.grad_fn where the caller has it."""
    if x._is_view():  # the common cases in one step: an activation's view, weight.t()
        base = x._base
        node = base.grad_fn
        if node is None:
            return base.requires_grad
    elif node is None:
        node = x.grad_fn
    for _ in range(6):
        if node is None:
            return False
        name = _node_name(node)
        if name == "torch::autograd::AccumulateGrad":
            return True
        if name not in _VIEW_OR_COPY_NODES:
            return False
        nexts = [n for n, _ in node.next_functions if n is not None]
        if len(nexts) != 1:
            return False
        node = nexts[0]
    return False


class compress_activations(_Recomputer, _Unpacker):  # noqa: N801  (a context manager used like a function)
    """Hold the floating-point tensors autograd saves for backward in FP8 inside this context.

    Each saved tensor is packed by the policy's granularity for its op kind and restored (original
    dtype and shape) when backward needs it; parameters, buffers, tensors that stay alive anyway,
    integer tensors and tensors below `min_numel` are kept as they are. Enter it outside any
    torch.compile'd call (for compiled graphs see CompiledActivations). The module docstring says
    how it works.

    Args:
        policy (`ActivationPolicy`, *optional*): what to do per op kind; defaults to
            `ActivationPolicy()` (COAT's mixed granularity).
        **overrides: fields of the policy to replace, e.g. `attention="keep"`, `fmt="e5m2"`,
            `min_numel=0`; `**KEEP_ALL` compresses nothing (a baseline counted the same way).

    Returns:
        `compress_activations`: the context itself on `with ... as ctx`; `ctx.stats`
        (`ActivationStats`) says what was packed, recomputed and kept, and why.

    Raises:
        TypeError: an unknown override or a `policy` that is not an ActivationPolicy.
        ValueError: an invalid policy value (a granularity, format or group size).
        RuntimeError: entered inside a torch.compile'd function, or re-entered while active.

    Example:
        >>> with coatstate.compress_activations() as ctx:
        ...     loss = model(x).loss
        >>> loss.backward()
        >>> print(ctx.stats.summary())
    """

    def __init__(self, policy: ActivationPolicy | None = None, **overrides) -> None:
        self.policy = ActivationPolicy.resolve(policy, overrides)
        self._stats = ActivationStats()
        self._kept_log: list = []  # per save, not yet in _stats: see ActivationStats.add_logged
        self._packed_log: list[tuple] = []
        self._granularity = {kind: (self.policy.granularity(kind), kind.value) for kind in OpKind}
        self._min_numel = max(self.policy.min_numel, 1)
        self._small = KeepReason.small(self.policy.min_numel)  # (built once: it is a key per save)
        self._recompute = self.policy.recompute
        self._fmt, self._group_size = self.policy.fmt, self.policy.group_size
        self._triton, self._auto = self.policy.backend == "triton", self.policy.backend == "auto"
        self._regions: dict[int, list[weakref.ref]] = {}  # storage pointer -> held regions in it
        self._sources: dict = {}  # (thread, node sequence nr) -> (weak handle, ptr) of its input
        self._pending: list[_Pending] = []  # attention inputs waiting for their op's output
        self._pending_seq = (0, -1)  # (thread, sequence number) of the attention node they belong to
        self._first_seq = 0  # autograd nodes numbered below this existed before __enter__
        self._thread = None
        self._slots: dict = {}  # device -> (amax int32 slots, scale byte slots, next free slot)
        self._graph_args = None  # the arguments of the compiled graph whose saves are being packed
        self._graph_inputs: tuple[set, set] = (set(), set())  # their storages, their parameters' shapes
        self._hooks = None

    # -- context ---------------------------------------------------------------------------
    def __enter__(self) -> compress_activations:
        if _is_compiling():
            _refuse_compiled()
        if self._hooks is not None:
            raise RuntimeError("this compress_activations context is already active; create a new one")
        if sys.version_info < (3, 11):
            warnings.warn(_OLD_PYTHON, stacklevel=2)
        self._first_seq, self._thread = _next_sequence_nr(), threading.get_ident()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._resolve_pending()
        self._hooks.__exit__(*exc)
        self._hooks = None
        self._regions.clear()
        self._sources.clear()
        self._slots.clear()
        self._graph_args, self._graph_inputs = None, (set(), set())
        if exc[0] is None:
            self._warn_if_only_small()

    @property
    def stats(self) -> ActivationStats:
        """What was packed and kept so far (saves are logged, and counted when this is read)."""
        self._count_logged()
        return self._stats

    def _count_logged(self) -> None:
        kept, self._kept_log = self._kept_log, []
        packed, self._packed_log = self._packed_log, []
        self._stats.add_logged(kept, packed)

    def _warn_if_only_small(self) -> None:
        """A model whose saves are all below min_numel (a small one) would otherwise compress
        nothing without a word; a policy that keeps everything on purpose is not warned about."""
        stats, reason = self.stats, KeepReason.small(self.policy.min_numel)
        if stats.packed or stats.recomputed or not stats.kept_reasons[reason]:
            return
        if all(self.policy.granularity(kind) is _KEEP for kind in OpKind):
            return
        warnings.warn(
            f"compress_activations compressed nothing: {stats.kept_reasons[reason]} floating-point "
            f"saved tensors ({stats.bytes_kept[reason] / 2**20:.2f} MiB) were smaller than "
            f"min_numel={self.policy.min_numel} and were kept as they are. For a small model pass a "
            "lower min_numel, e.g. compress_activations(min_numel=0); ctx.stats.summary() lists "
            "what was kept.",
            UserWarning,
            stacklevel=3,
        )

    # -- pack ------------------------------------------------------------------------------
    def _keep(self, x: torch.Tensor, reason: str, count_bytes: int | None = None) -> _Kept:
        log = self._kept_log
        log.append(reason)  # (two appends, no tuple: nothing for the GC to track)
        log.append(x.nbytes if count_bytes is None else count_bytes)
        if len(log) > _MAX_LOG:  # (one context around many steps: count as it goes)
            self._count_logged()
        return _Kept(x.detach() if x.requires_grad else x, x._version, reason)

    def _always_kept(self, x: torch.Tensor) -> str | None:
        if x.dtype not in FLOAT_DTYPES:
            return KeepReason.NOT_FLOAT
        node = x.grad_fn
        if node is None:
            if x.requires_grad:
                return KeepReason.LEAF
            return KeepReason.NO_GRAD_FN
        if x.numel() < self._min_numel:
            return self._small
        if node._sequence_nr() < self._first_seq and _thread_id() == self._thread:
            return KeepReason.BEFORE_CONTEXT
        if _derived_from_parameter(x):
            return KeepReason.PARAMETER_CAST
        return None

    def _pack(self, x: torch.Tensor):
        if self._pending and (_thread_id(), _next_sequence_nr() - 1) != self._pending_seq:
            self._resolve_pending()  # an attention op that saved no output of its own (math backend)
        frame = sys._getframe(1)  # the Python code calling the op that saves x
        node = x.grad_fn
        if node is None:  # (_always_kept's checks, in its order, for the cases that decide them here)
            if frame.f_code is _FUNCTION_APPLY and not x.requires_grad:
                return self._compiled_save(x, frame)
            if x.dtype not in FLOAT_DTYPES:
                return self._keep(x, _NOT_FLOAT)
            return self._keep(x, _LEAF if x.requires_grad else _NO_GRAD_FN)
        if x.dtype not in FLOAT_DTYPES:
            return self._keep(x, _NOT_FLOAT)
        if x.numel() < self._min_numel:
            return self._keep(x, self._small)
        if node._sequence_nr() < self._first_seq and _thread_id() == self._thread:
            return self._keep(x, _BEFORE_CONTEXT)
        if (x._is_view() or (_NODE_NAMES.get(type(node)) or _node_name(node)) in _CAST_OR_LEAF) and (
            _derived_from_parameter(x, node)  # (only views and casts can be: most saves skip the call)
        ):
            return self._keep(x, _PARAMETER_CAST)
        kind = kind_of_call_site(frame.f_code, frame.f_lasti)
        if kind is _OTHER:
            kind = kind_on_stack(frame)
        if kind is _ATTENTION:
            return self._attention(x, node)
        granularity, label = self._granularity[kind]
        return self._hold(x, granularity, label, kind is _ACTIVATION and self._recompute)

    def _compiled_save(self, x: torch.Tensor, frame):
        """A tensor an autograd.Function's forward made and saved (no grad_fn): if the Function is
        a torch.compile'd graph, pack it unless it is the graph's input or a parameter's cast."""
        cls = frame.f_locals.get("cls")
        if not getattr(cls, "__module__", "").startswith(_AOT_MODULE):  # an eager autograd.Function
            return self._keep(x, self._always_kept(x))
        if x.dtype not in FLOAT_DTYPES:
            return self._keep(x, KeepReason.NOT_FLOAT)
        if x.numel() < self._min_numel:
            return self._keep(x, self._small)
        args = frame.f_locals.get("args")
        if args is not self._graph_args:  # the first save of this call of the graph
            self._graph_args = args
            storages, shapes = set(), set()
            for a in args or ():
                if isinstance(a, torch.Tensor):
                    storages.add(a.untyped_storage().data_ptr())
                    if a.requires_grad and a.dim() >= 2:
                        shapes.add(tuple(a.shape))
            self._graph_inputs = (storages, shapes)
        storages, shapes = self._graph_inputs
        if x.untyped_storage().data_ptr() in storages:
            return self._keep(x, KeepReason.GRAPH_INPUT)
        if tuple(x.shape) in shapes:  # autocast's bf16 weight, as eager keeps it (a shape match
            return self._keep(x, KeepReason.PARAMETER_CAST)  # can only keep too much, never lose)
        if x.dtype is torch.float32:
            # not when compiled saves are all kept on purpose (KEEP_ALL: counting, not compressing)
            keep_asked = self.policy.compiled is _KEEP
            if self.policy.compiled_fp32 is _KEEP and not keep_asked and not _WARNED["compiled_fp32"]:
                _WARNED["compiled_fp32"] = True  # once per process: a context is made every step
                warnings.warn(_COMPILED_FP32, stacklevel=2)
            return self._hold(x, self.policy.compiled_fp32, "compiled_fp32")
        return self._hold(x, self.policy.compiled, "compiled")

    def _attention(self, x: torch.Tensor, node):
        """q, k, v wait for the op's output, whose grad_fn (`node`) lists the op's inputs in order."""
        seq = _next_sequence_nr() - 1  # the attention op's node: made before it saves anything
        # (sequence numbers count per thread)
        if node._sequence_nr() != seq:  # an input
            pending = _Pending(x)
            self._pending.append(pending)
            self._pending_seq = (_thread_id(), seq)
            return pending
        nexts = node.next_functions
        q, k = nexts[0][0], nexts[1][0] if len(nexts) > 1 else None  # q's and k's grad_fns
        pending, self._pending = self._pending, []
        is_qk = [fn is not None and fn in (q, k) for fn in [p.tensor.grad_fn for p in pending]]
        for p, qk in zip(pending, is_qk, strict=True):  # q and k first: a shared qkv storage is theirs
            if qk:
                self._settle(p, "attention")
        for p, qk in zip(pending, is_qk, strict=True):
            if not qk:
                self._settle(p, "attention_v_out")
        return self._hold(x, self.policy.attention_v_out, "attention_v_out")

    def _settle(self, pending: _Pending, label: str) -> None:
        x, pending.tensor = pending.tensor, None
        if x._version != pending.version:  # modified in place since: keep it so that backward raises
            kept = self._keep(x, _policy_keeps(label))
            kept.version = pending.version
            pending.held = kept
        else:
            pending.held = self._hold(x, getattr(self.policy, label), label)

    def _resolve_pending(self) -> None:
        pending, self._pending = self._pending, []
        for p in pending:
            self._settle(p, "attention_v_out")

    def _find(self, ptr: int, x: torch.Tensor, lo: int, hi: int) -> _Region | None:
        """The first live region at `ptr` that holds x's elements [lo, hi]. Regions of freed storages
        that once lived there are dropped on the way (the CPU allocator reuses addresses within a
        forward, and each would be checked again at every later save there)."""
        refs = self._regions.get(ptr)
        if not refs:
            return None
        dtype, version, stale = x.dtype, x._version, False
        for ref in refs:
            region = ref()
            if region is None or _expired(region.cdata):
                stale = True
            elif (
                region.start <= lo
                and hi < region.stop
                and dtype == region.dtype
                and version == region.version
            ):
                return region
        if stale:
            refs[:] = [r for r in refs if r() is not None and not r().expired()]
        return None

    def _register(self, ptr: int, region: _Region) -> None:
        refs = self._regions.get(ptr)
        if refs is None:
            self._regions[ptr] = [weakref.ref(region)]
            return
        if len(refs) > 8:  # drop regions of freed storages that once lived at this address
            refs[:] = [r for r in refs if r() is not None and not r().expired()]
        refs.append(weakref.ref(region))

    def _hold(self, x: torch.Tensor, granularity: Granularity, label: str, source: bool = False):
        """Pack x (or share the region that already holds its memory, or keep it); `source`: x is
        the input of an activation function whose output may be recomputed from it."""
        if _is_compiling():  # (here, not per save: a traced hook reaches this with any real activation)
            _refuse_compiled()
        shape, stride = x.shape, x.stride()
        extent, dense, row, expanded = _layout(shape, stride)
        if expanded:
            return self._keep(x, "expanded (stride-0) view")
        lo = x.storage_offset()
        hi = lo + extent
        storage = x.untyped_storage()
        ptr = storage.data_ptr()
        region = self._find(ptr, x, lo, hi)
        if region is not None:
            self._stats.shared += 1
            region.shared = True
            handle = self._view_of(region, x, shape, stride, lo)
        else:
            if dense:
                start, stop = lo, hi + 1
            else:
                stop = storage.nbytes() // x.element_size()
                start = 0 if stop <= _MAX_STORAGE_PER_VIEW * x.numel() else None
            if granularity is _BF16 and x.dtype is not torch.float32:
                granularity = _KEEP  # already 16-bit: holding it as bfloat16 would save nothing
            if granularity is _KEEP:
                reason = _policy_keeps(label)
                if start is None:
                    return self._keep(x, reason)
                kept = self._keep(x, reason, (stop - start) * x.element_size())
                kept.region = _KeptRegion(storage, start, stop, x.dtype, x.device, x._version, reason)
                self._register(ptr, kept.region)
                return kept
            if start is None:  # a sparse view of a large storage: pack a contiguous copy, unshared
                base = x.contiguous()
                region = self._compress(
                    base, base.untyped_storage(), 0, base.numel(), base._version, granularity, row, label, 0
                )
                return self._view_of(region, base, base.shape, base.stride(), base.storage_offset())
            region = None
            if self._sources and x.grad_fn is not None:  # (a compiled graph's save has none)
                region = self._recompute_region(ptr, x, storage, start, stop)
            if region is None:
                region = self._compress(x, storage, start, stop, x._version, granularity, row, label, lo)
                if dense and region.kernel:  # its one handle covers it: backward unpacks into that layout
                    region.layout = (tuple(shape), stride)
            self._register(ptr, region)
            handle = _Handle(region, tuple(shape), stride, lo - start)  # (a tuple: GC untracks it)
        if source and type(handle) is _Handle and type(handle.region) is _Packed:
            self._note_source(handle, ptr)
        return handle

    def _view_of(self, region: _Region, x: torch.Tensor, shape, stride, off: int):
        """What autograd holds for a save of x (shape, stride and storage offset) inside region."""
        if type(region) is _KeptRegion:
            return _Kept(x.detach(), x._version, region.reason, region)
        return _Handle(region, tuple(shape), stride, off - region.start)

    def _compress(
        self, x, storage, start: int, stop: int, version: int, granularity, row: int, label: str, off: int
    ):
        """A _Packed region of x's elements [start, stop) of its storage (x's own offset is `off`)."""
        n = stop - start
        row = row if 0 < row and n % row == 0 else n
        fmt, group_size = self._fmt, self._group_size
        packed = _Packed(storage, start, stop, x.dtype, x.device, version, granularity, row, group_size, fmt)
        if granularity is _BF16:
            if off == start and x.is_contiguous():  # x is the whole region: no flat view of it first
                packed.codes = x.to(torch.bfloat16)
                if packed.codes.stride() == x.stride():  # (backward's .to() gives that layout back)
                    packed.layout = (tuple(x.shape), x.stride())
            else:
                packed.codes = x.as_strided((n,), (1,), start).to(torch.bfloat16)
            nbytes = 2 * n
        elif self._triton or (self._auto and triton_usable(x.device)):
            K = kernels()
            base = x if off == start else x.as_strided((n,), (1,), start)
            packed.kernel = True
            if granularity is _TENSOR:  # codes, and a byte in the slot buffer
                amax, packed.scales, packed.slot = self._slot(x.device)
                packed.codes = K.pack_tensor_flat(base, n, fmt, amax, packed.scales, packed.slot)
                nbytes = n + 1
            else:  # codes and scale bytes in one buffer
                packed.codes = K.pack_groups_flat(base, n, row, group_size, fmt)
                nbytes = packed.codes.numel()
        else:
            if granularity is _TENSOR:
                packed.codes, packed.scales = codec.pack_tensor(x.as_strided((n,), (1,), start), fmt)
            else:
                rows2d = x.as_strided((n // row, row), (row, 1), start)
                packed.codes, packed.scales = codec.pack_groups(rows2d, group_size, fmt)
            nbytes = packed.codes.numel() + packed.scales.numel()
        self._packed_log.append((label, granularity, n * x.element_size(), nbytes))
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


_OLD_PYTHON = (
    "compress_activations on Python < 3.11: its bytecode has no source positions, so op kinds come "
    "only from the module running the op (norms, activation-function modules); F.linear, matmul and "
    "attention count as 'other' (per-group by default, attention v/out compressed). Use Python >= 3.11 "
    "for COAT's policy, or set `other=` to the granularity you want for them."
)
_WARNED = {"compiled_fp32": False}
_COMPILED_FP32 = (
    "compress_activations: a torch.compile'd graph saved float32 activations, which the policy keeps "
    "uncompressed (compiled_fp32='keep': at run time a norm's input cannot be told from attention's "
    "logsumexp, which even bfloat16 would distort). Under bf16 autocast that is the residual stream; "
    "in a float32 model it is every activation. Pass compiled_fp32='bf16' (or 'group') to hold them "
    "compressed, after checking your gradients; see ctx.stats.summary() for the bytes."
)
_COMPILE_ERROR = (
    "compress_activations cannot run inside a torch.compile'd function (its hooks would be traced "
    "away or do nothing): enter it OUTSIDE the compiled call, e.g. `with compress_activations(): "
    "loss = compiled_model(x)`; the compiled graph's saved tensors are then compressed at run time."
)


def _raise_compile_error() -> None:
    raise RuntimeError(_COMPILE_ERROR)


@functools.cache
def _disabled_raise():
    return torch.compiler.disable(_raise_compile_error)


def _refuse_compiled() -> None:
    """Raised at run time: dynamo leaves the raising call out of the graph instead of tracing the
    raise (wrapped at first use: torch.compiler.disable imports dynamo, ~1 s at import time)."""
    _disabled_raise()()
