"""Activation memory of a real model, measured on CPU and scaled to the planned job.

A trace runs forward + backward of the model cut down to a few of its repeated layers (the rest
of the model kept whole) at a few small token counts, as CPU tensors in the job's dtype, under
compress_activations. By default the tensors are fake (torch's FakeTensorMode): every op runs
through the same Python code, autocast, autograd and saved-tensor hooks and makes outputs with
real shapes, dtypes, strides and storage sizes, but computes no values and allocates nothing, so
a 70B model traces in seconds; `real=True` computes on real tensors (the reference the fake
trace is tested against). Two things are measured per run:

- saved activation bytes, from compress_activations' own ActivationStats (what it would hold
  uncompressed, and what it holds), attributed to each layer by snapshots at layer boundaries;
- live memory: every storage an op creates during the step is counted until it is freed (a
  TorchDispatchMode plus weak references), which gives the bytes alive at the end of forward
  per layer and outside the layers, and the extra bytes alive at the step's peak (autocast's
  weight copies, the loss's logits, gradients of activations, unpacked activations in backward).

The 'compiled' kind compiles each traced block with CompiledActivations' partitioner instead of
entering compress_activations (coatstate.planner.compiled_trace); there the live bytes at the end
of forward are the saved activations.

Each quantity q is fitted as q = a + b*B*S from runs at (B, S) = (b, s) and (2b, s), and
per-layer quantities are multiplied by the model's layer count; the transient is fitted at every
sampled moment of the step and the largest line taken (PeakFit), since the peak moves. The fit
assumes activations grow with the token count B*S: true for flash/memory-efficient attention
(what F.scaled_dot_product_attention uses); a model with eager softmax(QK^T) attention (a
seq x seq tensor per head) is under-predicted at sequence lengths above the trace's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from coatstate.activations.hooks import compress_activations
from coatstate.activations.policy import KEEP_ALL, ActivationPolicy
from coatstate.planner import compiled_trace

KINDS = ("none", "compressed", "fp8", "compiled")
"""Trace kinds: nothing compressed; compress_activations; the same with FP8 linear layers; FP8
linear layers in blocks compiled with CompiledActivations (coatstate.planner.compiled_trace)."""


def storage_key(t: torch.Tensor) -> int:
    """The identity of t's storage (its StorageImpl), shared by every view of it: fake storages
    all have data pointer 0."""
    return t.untyped_storage()._cdata


class LiveBytes(TorchDispatchMode):
    """Bytes of storages created inside the mode and still alive; `peak` is the maximum seen."""

    def __init__(self, ignore: set[int]) -> None:
        super().__init__()
        self.ignore = ignore  # storage_key()s of what existed before (params, grads, inputs)
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0
        self.pause_codes: set = set()  # code objects of functions whose temporaries are left out
        self.samples: list[int] = []  # the live bytes at every sample of the peak, in order
        self._unsampled = False  # storages were added while paused and the peak has not seen them
        self.deferred: set[int] = set()  # pointwise outputs inside a compiled graph (compiled_trace)

    def __enter__(self):
        compiled_trace.FUSED.trackers.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        compiled_trace.FUSED.trackers.remove(self)
        return super().__exit__(*exc)

    def _add(self, key: int, st) -> None:
        self.deferred.discard(key)
        if key not in self.live:
            self.live[key] = (StorageWeakRef(st), st.nbytes())
            self.current += st.nbytes()

    def materialize(self, tensors) -> None:
        """A compiled graph returned `tensors`: those of its fused intermediates are buffers."""
        self.sweep()
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor) and storage_key(t) in self.deferred:
                self._add(storage_key(t), t.untyped_storage())
        self.deferred.clear()
        self.peak = max(self.peak, self.current)
        self.samples.append(self.current)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # dynamo skips compiling (runs eagerly) under a dispatch mode that does not say this: the
        # 'compiled' trace needs its blocks compiled, and the mode to see their graphs' ops
        return True

    def _paused(self) -> bool:
        f = sys._getframe(2)
        for _ in range(64):
            if f is None:
                return False
            if f.f_code in self.pause_codes:
                return True
            f = f.f_back
        return False

    def sweep(self) -> int:
        """Drop freed storages; returns the bytes alive now."""
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            self.current -= self.live.pop(k)[1]
        return self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        new = []
        if compiled_trace.FUSED.depth and torch.Tag.reduction not in func.tags:
            if torch.Tag.pointwise in func.tags:  # fused into its consumer: a buffer only if read
                for t in tree_flatten(out)[0]:  # by an extern kernel or returned (materialize)
                    if isinstance(t, torch.Tensor) and storage_key(t) not in self.live:
                        self.deferred.add(storage_key(t))
                return out
            for t in tree_flatten((args, kwargs))[0]:  # an extern kernel reads buffers
                if isinstance(t, torch.Tensor) and storage_key(t) in self.deferred:
                    new.append((storage_key(t), t.untyped_storage()))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                key = st._cdata
                if key in self.ignore or st.nbytes() == 0:
                    continue
                entry = self.live.get(key)
                if entry is None or entry[0].expired():  # (a freed storage's address reused)
                    new.append((key, st))
        # Between allocations the live bytes only fall, so the peak is sampled after ops that
        # allocate (and after the first op past a paused stretch that did): one sweep each.
        if not (new or self._unsampled):
            return out
        self.sweep()
        for key, st in new:
            self._add(key, st)
        if self.pause_codes and self._paused():
            self._unsampled = True
        else:
            self.peak = max(self.peak, self.current)
            self.samples.append(self.current)
            self._unsampled = False
        return out


def find_layers(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """(parent, attribute, list) of the ModuleList of same-class blocks holding the most parameters."""
    best, best_params = None, -1
    for parent in model.modules():
        for attr, child in parent.named_children():
            if isinstance(child, nn.ModuleList) and len(child) >= 1 and len({type(m) for m in child}) == 1:
                n = sum(p.numel() for p in child.parameters())
                if n > best_params:
                    best, best_params = (parent, attr, child), n
    if best is None:
        raise ValueError(
            "the model has no nn.ModuleList of repeated blocks (transformer layers): the planner "
            "traces a few of them and scales by the layer count; keep the blocks in an nn.ModuleList"
        )
    return best


@contextlib.contextmanager
def fake_tensors() -> Iterator[None]:
    """Tensors made inside are fake (torch's FakeTensorMode): shapes, dtypes, strides and storage
    sizes without values or memory; factory calls under torch.device('meta') stay meta.

    Inside, UntypedStorage.data_ptr() gives each meta storage (what a fake tensor's storage is)
    its own number instead of 0: compress_activations finds the region that already holds a
    saved tensor's memory by its storage's data pointer, and would take every fake storage for
    one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cls = torch.UntypedStorage
    own = cls.__dict__.get("data_ptr")  # None: inherited from torch._C.StorageBase
    real = cls.data_ptr
    cls.data_ptr = lambda self: self._cdata if self.device.type == "meta" else real(self)
    try:
        with FakeTensorMode():
            yield
    finally:
        if own is None:
            del cls.data_ptr
        else:
            cls.data_ptr = own


def _replace_tensors(model: nn.Module, make: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """Every parameter and buffer p replaced by make(p), in place (shared ones stay shared):
    Module.to_empty and .to swap tensors, which fake tensors refuse."""
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table, wrap in ((module._parameters, True), (module._buffers, False)):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in done:
                    new = make(t)
                    done[id(t)] = nn.Parameter(new, t.requires_grad) if wrap else new
                table[name] = done[id(t)]
    return model


def materialize(model: nn.Module) -> nn.Module:
    """A meta-device model on CPU with finite placeholder values (values do not change bytes).
    Tied parameters stay tied: Module.to_empty would give each module its own copy."""
    model = _replace_tensors(
        model, lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.02) if p.dim() >= 2 else p.fill_(1.0 if name.endswith("weight") else 0.0)
        for b in model.buffers():
            if b.is_floating_point():
                b.uniform_(-1.0, 1.0)
            else:
                b.zero_()
    return model


def call_loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """forward(idx, targets) -> loss, or forward(idx) -> logits (then mean cross-entropy)."""
    positional = [
        p
        for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    out = model(idx, idx) if len(positional) >= 2 else model(idx)
    for attr in ("loss", "logits"):  # a transformers-style output object
        if isinstance(getattr(out, attr, None), torch.Tensor):
            out = getattr(out, attr)
            break
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the model returned {type(out).__name__}; it must return a loss or logits tensor")
    if out.dim() == 0:
        return out
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).float(), idx.reshape(-1))


@dataclasses.dataclass(frozen=True)
class RunBytes:
    """One trace run: bytes per layer (from entering the last but one traced layer to entering
    the last) and the rest."""

    saved_layer: float
    saved_rest: float
    live_layer: float
    live_rest: float
    transient: float
    """Bytes alive at the step's peak beyond those alive at the end of forward."""
    moments: tuple[int, ...] = ()
    """Bytes alive beyond those at the end of forward at every moment the live bytes were
    sampled, in order (`transient` is the largest)."""


def _run(model, layers: nn.ModuleList, idx, *, kind: str, autocast: bool, vocab: int) -> RunBytes:
    for p in model.parameters():  # allocated beforehand, as with zero_grad(set_to_none=False)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    static = {storage_key(t) for t in (*model.parameters(), *model.buffers(), idx)}
    static |= {storage_key(p.grad) for p in model.parameters()}
    tracker = LiveBytes(static)
    if kind == "compiled":
        # No hooks: the compiled blocks hold what their partitioned graphs save (compiled_trace),
        # and the eager rest of the model what autograd saves. What is held at the end of forward
        # is the saved activations, as the benchmarks measure them on the GPU.
        ctx, held = contextlib.nullcontext(), tracker.sweep
    else:
        ctx = compress_activations() if kind != "none" else compress_activations(**KEEP_ALL)
        held = lambda: ctx.stats.activation_bytes_held  # noqa: E731
    # On CPU, pack/unpack run as chains of float32 torch ops whose temporaries are several times
    # the tensor; on CUDA one Triton kernel writes codes or the unpacked tensor directly. The
    # temporaries are left out of the peak (found by the hooks' frames on the stack: wrapping the
    # hooks would change the call site compress_activations reads); what a hook returns or keeps
    # still counts.
    tracker.pause_codes = {
        getattr(type(ctx), n).__code__
        for n in ("_pack", "_unpack")
        if hasattr(getattr(type(ctx), n, None), "__code__")
    }
    # (saved, live) on entering each layer. A layer's bytes are those added from entering it to
    # entering the next: by then the caller has dropped the layer's input (x = layer(x)), which
    # a snapshot at the layer's own exit would still count.
    marks: list[tuple[int, int]] = []
    mark = lambda *_: marks.append((held(), tracker.sweep()))  # noqa: E731
    hooks = [m.register_forward_pre_hook(mark) for m in layers]
    try:
        with tracker:
            with ctx, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = call_loss(model, idx % vocab)
            saved_end, live_end = held(), tracker.sweep()
            forward_marks = list(marks)  # backward may re-run layers (activation checkpointing)
            loss.backward()
            del loss
    finally:
        for h in hooks:
            h.remove()
    # one layer: the model has just that one (trace() traces at least 2 otherwise), all is "rest"
    (s0, l0), (s1, l1) = forward_marks[-2:] if len(forward_marks) >= 2 else ((0, 0), (0, 0))
    n = len(layers)
    return RunBytes(
        s1 - s0,
        saved_end - n * (s1 - s0),
        l1 - l0,
        live_end - n * (l1 - l0),
        max(0, tracker.peak - live_end),
        tuple(c - live_end for c in tracker.samples),
    )


@dataclasses.dataclass(frozen=True)
class TokenFit:
    """q(B, S) = a + b*B*S."""

    a: float
    b: float

    def __call__(self, batch: int, seq: int) -> float:
        return max(0.0, self.a + self.b * batch * seq)

    @classmethod
    def fit(cls, q1: float, q2: float, tokens1: int, tokens2: int) -> TokenFit:
        b = (q2 - q1) / (tokens2 - tokens1)
        return cls(q1 - b * tokens1, b)


@dataclasses.dataclass(frozen=True)
class PeakFit:
    """q(B, S) = the largest of several lines a + b*B*S, one per moment of the step at which the
    live bytes were sampled: the peak falls at different moments at different token counts (at
    few tokens where a fixed-size buffer such as the head's weight gradient is alive, at many
    where the loss's logits and their gradients are), which one line through the two runs'
    peaks misses. Only lines that are the largest somewhere at B*S >= 0 are kept."""

    lines: tuple[TokenFit, ...]

    def __call__(self, batch: int, seq: int) -> float:
        return max(0.0, max(f.a + f.b * batch * seq for f in self.lines))

    @classmethod
    def fit(cls, q1: Iterable[float], q2: Iterable[float], tokens1: int, tokens2: int) -> PeakFit:
        lines = {TokenFit.fit(x, y, tokens1, tokens2) for x, y in zip(q1, q2, strict=True)}
        best = max(lines, key=lambda f: (f.a, f.b))  # the maximum at no tokens
        kept = [best]
        while True:  # the line that overtakes the current maximum first, until none does
            later = [((best.a - f.a) / (f.b - best.b), -f.b, f) for f in lines if f.b > best.b]
            if not later:
                return cls(tuple(kept))
            best = min(later, key=lambda c: c[:2])[2]
            kept.append(best)


@dataclasses.dataclass(frozen=True)
class ActivationModel:
    """Fitted activation bytes of one variant (compressed or not) for the full model."""

    layers: int
    saved_layer: TokenFit
    saved_rest: TokenFit
    live_layer: TokenFit
    live_rest: TokenFit
    transient: TokenFit | PeakFit
    trace_points: tuple[tuple[int, int], ...]

    def saved(self, batch: int, seq: int) -> int:
        """Activation bytes held for backward (ActivationStats' accounting)."""
        return round(self.layers * self.saved_layer(batch, seq) + self.saved_rest(batch, seq))

    def peak(self, batch: int, seq: int) -> int:
        """Bytes beyond params, grads and optimizer states at the step's peak."""
        live = self.layers * self.live_layer(batch, seq) + self.live_rest(batch, seq)
        return round(live + self.transient(batch, seq))


def trace_shape(seq: int, hidden: int, min_numel: int) -> tuple[int, int]:
    """(batch, seq) of the trace's first run (the second doubles the batch): a (batch, seq,
    hidden) activation must reach compress_activations' min_numel, so the trace compresses what
    the job would (smaller tensors are kept); seq is at most the job's."""
    s = min(seq, 16 * math.ceil(max(64, math.ceil(min_numel / hidden)) / 16))
    return max(1, math.ceil(min_numel / (s * hidden))), s


class Progress:
    """A line on stderr per stage once the work has taken longer than `after` seconds (a timer
    prints the stage in progress then), and one when it is done; nothing for faster work.

        with Progress() as report:
            report("tracing ...")
    """

    def __init__(self, after: float = 2.0, stream=None, enabled: bool = True) -> None:
        self.after, self.stream, self.enabled = after, stream, enabled
        self.stage, self.printed = "", False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def __enter__(self) -> Progress:
        self.start = time.perf_counter()
        if self.enabled:
            self._timer = threading.Timer(self.after, self._late)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self.stage = ""
            if self.printed and exc[0] is None:
                self._print("done")

    def __call__(self, stage: str) -> None:
        with self._lock:
            self.stage = stage
            if self.enabled and time.perf_counter() - self.start >= self.after:
                self._print(stage)

    def _late(self) -> None:
        with self._lock:
            if self.stage:
                self._print(f"{self.stage} ...")

    def _print(self, text: str) -> None:
        elapsed = time.perf_counter() - self.start
        print(f"coatstate plan: {text} ({elapsed:.1f} s)", file=self.stream or sys.stderr, flush=True)
        self.printed = True


def trace(
    build: Callable[[int], nn.Module],
    *,
    layers: int,
    seq: int,
    hidden: int,
    vocab: int,
    autocast: bool,
    dtype: torch.dtype,
    trace_layers: int = 2,
    kinds: Iterable[str] = ("none", "compressed"),
    fp8_convert: Callable[[nn.Module], nn.Module] | None = None,
    real: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, ActivationModel]:
    """Fitted activation models per kind for the full `layers`.

    Kinds: 'none' (nothing compressed), 'compressed' (compress_activations' default policy),
    'fp8' (the same, with nn.Linear layers swapped by `fp8_convert`), 'compiled' (FP8 linear
    layers, each repeated block compiled with CompiledActivations: compiled_trace). build(k)
    returns the model with k repeated layers on CPU, or on the meta device (then materialized
    with placeholders).
    real=False traces fake tensors (no values, no memory), and falls back to real ones with a
    warning for a model whose forward needs values (`.item()`, data-dependent shapes);
    real=True computes every op. `progress(text)` is told each stage.
    """
    from torch._subclasses import fake_tensor

    k = min(max(2, trace_layers), layers)
    b, s = trace_shape(seq, hidden, ActivationPolicy().min_numel)
    kinds = sorted(set(kinds), key=KINDS.index)
    if {"fp8", "compiled"} & set(kinds) and fp8_convert is None:
        raise ValueError("the 'fp8' and 'compiled' traces need fp8_convert (coatstate.nn.FP8Linear)")
    args = (build, k, layers, ((b, s), (2 * b, s)), vocab, autocast, dtype, kinds, fp8_convert, progress)
    if real:
        return _trace(*args, fake=False)
    try:
        with fake_tensors():
            return _trace(*args, fake=True)
    except (fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException) as e:
        warnings.warn(
            f"the model's forward needs tensor values ({type(e).__name__}: {e}), which the planner's "
            "fake-tensor trace does not compute: tracing it with real tensors instead (slower, and "
            "it allocates the traced layers)",
            stacklevel=3,
        )
        return _trace(*args, fake=False)


def _trace(build, k, layers, points, vocab, autocast, dtype, kinds, fp8_convert, progress, *, fake):
    out, model = {}, None
    (b, s), _ = points
    for kind in kinds:
        if progress:
            progress(f"tracing {k} of {layers} layers ({kind}) at batch {b} and {2 * b} x seq {s}")
        if model is None or kind in ("fp8", "compiled"):
            model = _prepare(build, k, dtype, fake)
        if kind in ("fp8", "compiled"):
            model = fp8_convert(model)
        if kind == "compiled":
            partitioner = compiled_trace.CompiledActivations()
            compiled_trace.use_fp8_gemm(model)
            compiled_trace.compile_blocks(find_layers(model)[2], partitioner)
        _, _, blocks = find_layers(model)
        runs = []
        for batch, n in points:
            torch.manual_seed(0)
            idx = torch.randint(0, vocab, (batch, n))
            runs.append(_run(model, blocks, idx, kind=kind, autocast=autocast, vocab=vocab))
        tokens = (b * s, 2 * b * s)
        fits = {
            f.name: TokenFit.fit(*(getattr(r, f.name) for r in runs), *tokens)
            for f in dataclasses.fields(RunBytes)
            if f.name != "moments"
        }
        if len(runs[0].moments) == len(runs[1].moments) > 0:  # the same ops at both token counts
            fits["transient"] = PeakFit.fit(runs[0].moments, runs[1].moments, *tokens)
        out[kind] = ActivationModel(layers, trace_points=points, **fits)
        model.zero_grad(set_to_none=True)
        if kind == "compiled":
            compiled_trace.check_partitioned(partitioner, len(points))
    return out


def _prepare(build: Callable[[int], nn.Module], k: int, dtype: torch.dtype, fake: bool) -> nn.Module:
    model = build(k)
    if fake:  # one pass: CPU placement and the dtype cast of Module.to(dtype)
        model = _replace_tensors(
            model,
            lambda t: torch.empty_strided(
                t.shape, t.stride(), dtype=dtype if t.is_floating_point() else t.dtype, device="cpu"
            ),
        )
    else:
        if any(p.is_meta for p in model.parameters()):
            model = materialize(model)
        model = model.to(dtype)
    _, _, blocks = find_layers(model)
    if len(blocks) != k:
        raise ValueError(f"build({k}) returned a model with {len(blocks)} repeated layers; expected {k}")
    return model
