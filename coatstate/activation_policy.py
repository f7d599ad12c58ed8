"""Which saved activations compress_activations compresses, how they are held, and the report.

An op kind is decided from the CALL SITE that is running when autograd saves a tensor: the
innermost Python frame's current instruction is a call (or an operator such as `@`) into torch,
and the name it calls (`F.linear`, `torch.layer_norm`, `x.softmax`, ...) gives the kind. The
answer depends only on (code object, instruction offset), so it is worked out once per call site
(from the bytecode's source positions) and then read from a dict: no TorchFunctionMode, no cost
per op that saves nothing. For calls that say nothing by themselves (the pow/mul/rsqrt of a
hand-written RMSNorm) the innermost nn.Module.forward on the Python stack gives the kind.

The held format (docs/FORMAT.md, "Saved activations"): FP8 codes with power-of-two scales stored
as one byte each (E8M0: byte b is 2**(b-127), 255 marks a NaN/Inf maximum), one per tensor or one
per group of `group_size` along rows. `pack_tensor` ... `unpack_groups` below are the
pure-torch codec: the CPU path and the oracle of the Triton kernels in
coatstate.kernels.activation_pack, which compute the same integer and float32 operations.
"""

from __future__ import annotations

import collections
import dataclasses
import dis
import enum
import functools

import torch
import torch.nn.functional as F

from coatstate.formats.fp8 import FP8Format, round_to_fp8_grid


class Granularity(str, enum.Enum):
    """How a saved tensor is held until backward."""

    KEEP = "keep"
    """Uncompressed (the tensor itself)."""
    TENSOR = "tensor"
    """FP8 with one scale for the whole tensor (COAT's choice for linear inputs)."""
    GROUP = "group"
    """FP8 with one scale per group of `group_size` along the last dim (COAT's non-linear)."""
    BF16 = "bf16"
    """A float32 tensor held as bfloat16 (half the bytes, 8 significant bits); bfloat16 and
    float16 tensors are kept as they are."""


class OpKind(str, enum.Enum):
    """The kind of op that saved a tensor."""

    LINEAR = "linear"
    NORM = "norm"
    ACTIVATION = "activation"
    ATTENTION = "attention"
    LOSS = "loss"
    OTHER = "other"


_KIND_BY_NAME: dict[str, OpKind] = {}
for _kind, _names in {
    OpKind.LINEAR: "linear matmul __matmul__ __rmatmul__ mm bmm addmm baddbmm addbmm einsum mv addmv "
    "bilinear conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d",
    OpKind.NORM: "layer_norm rms_norm group_norm batch_norm instance_norm normalize local_response_norm",
    OpKind.ACTIVATION: "gelu silu relu relu6 sigmoid tanh softmax softmin mish elu selu celu leaky_relu "
    "hardswish hardsigmoid hardtanh softplus glu logsigmoid prelu",
    OpKind.ATTENTION: "scaled_dot_product_attention multi_head_attention_forward flex_attention",
    OpKind.LOSS: "cross_entropy cross_entropy_loss log_softmax nll_loss binary_cross_entropy "
    "binary_cross_entropy_with_logits kl_div mse_loss l1_loss smooth_l1_loss huber_loss",
}.items():
    for _name in _names.split():
        _KIND_BY_NAME[_name] = _kind


def kind_of_function(func) -> OpKind:
    """The op kind of a torch function (by name: F.linear, torch.matmul, Tensor.__matmul__, ...)."""
    return _KIND_BY_NAME.get(getattr(func, "__name__", ""), OpKind.OTHER)


_SITE_KINDS: dict = {}  # (id(code), offset) -> OpKind of the call made there
_SITE_CODES: dict = {}  # id(code) -> code: kept alive so that its id stays its own
_CALLEE_LOADS = frozenset(
    "LOAD_ATTR LOAD_METHOD LOAD_GLOBAL LOAD_NAME LOAD_FAST LOAD_FAST_CHECK LOAD_FAST_BORROW LOAD_DEREF "
    "LOAD_CLASSDEREF LOAD_SUPER_ATTR LOAD_FROM_DICT_OR_GLOBALS LOAD_FROM_DICT_OR_DEREF".split()
)


def kind_of_call_site(code, offset: int) -> OpKind:
    """The op kind of the call (or operator) at bytecode `offset` of `code`: a frame's
    (f_code, f_lasti) while torch runs the op. Cached per site; OTHER where it cannot tell."""
    key = (id(code), offset)  # (hashing a code object hashes its bytecode and constants)
    kind = _SITE_KINDS.get(key)
    if kind is None:
        _SITE_CODES[key[0]] = code
        kind = _SITE_KINDS[key] = _classify_site(code, offset)
    return kind


@functools.lru_cache(maxsize=256)
def _instructions(code) -> tuple:
    return tuple(dis.get_instructions(code))


def _classify_site(code, offset: int) -> OpKind:
    """The callee of a call is the longest name load that starts where the call expression starts
    and precedes it (`F.gelu` in `F.gelu(x)`, `mean` in `x.pow(2).mean(-1)`); an operator is
    LINEAR for `@`. Needs source positions in the bytecode (Python >= 3.11)."""
    if not hasattr(code, "co_positions"):
        return OpKind.OTHER
    instructions = _instructions(code)
    # the instruction at `offset`, or the one whose inline cache entries it points into (a frame
    # that called a Python function reports the end of the call's caches on 3.11 and 3.12)
    index = next((i for i in range(len(instructions) - 1, -1, -1) if instructions[i].offset <= offset), None)
    if index is None:
        return OpKind.OTHER
    call = instructions[index]
    if call.opname in ("BINARY_OP", "BINARY_MATRIX_MULTIPLY", "INPLACE_MATRIX_MULTIPLY"):
        return OpKind.LINEAR if "@" in call.argrepr or "MATRIX" in call.opname else OpKind.OTHER
    where = call.positions
    if "CALL" not in call.opname or where is None or where.lineno is None:
        return OpKind.OTHER
    start, end = (where.lineno, where.col_offset), (where.end_lineno, where.end_col_offset)
    callee, callee_end = None, None
    for ins in instructions[:index]:
        pos = ins.positions
        if ins.opname not in _CALLEE_LOADS or not isinstance(ins.argval, str) or pos is None:
            continue
        if (pos.lineno, pos.col_offset) == start and (pos.end_lineno, pos.end_col_offset) < end:
            if callee_end is None or (pos.end_lineno, pos.end_col_offset) >= callee_end:
                callee, callee_end = ins.argval, (pos.end_lineno, pos.end_col_offset)
    return _KIND_BY_NAME.get(callee, OpKind.OTHER) if callee else OpKind.OTHER


def kind_of_module(module: torch.nn.Module) -> OpKind:
    """Fallback kind from the module that runs the op (norm and activation-function modules)."""
    cls = type(module)
    if "norm" in cls.__name__.lower():
        return OpKind.NORM
    if cls.__module__ == "torch.nn.modules.activation" and not issubclass(cls, torch.nn.MultiheadAttention):
        return OpKind.ACTIVATION
    return OpKind.OTHER


_MODULE_KINDS: dict = {}  # id(code) -> (code, OpKind of the module whose forward it is, or None)


def kind_on_stack(frame) -> OpKind:
    """Kind of the innermost nn.Module whose forward is on the Python stack from `frame` up."""
    for _ in range(10):
        if frame is None:
            break
        code = frame.f_code
        entry = _MODULE_KINDS.get(id(code))  # (the entry keeps `code`, so its id stays its own)
        if entry is None:  # first sight of this code: is it a module's forward?
            owner = frame.f_locals.get("self") if code.co_name == "forward" else None
            entry = (code, kind_of_module(owner) if isinstance(owner, torch.nn.Module) else None)
            _MODULE_KINDS[id(code)] = entry
        kind = entry[1]
        if kind is not None:
            return kind
        frame = frame.f_back
    return OpKind.OTHER


# Activation functions whose output is f(saved input): autograd node name -> (f, its kwargs read
# off the node's non-tensor attributes, which reading does not unpack).
RECOMPUTABLE = {
    "GeluBackward0": lambda n: (F.gelu, {"approximate": n._saved_approximate}),
    "SiluBackward0": lambda n: (F.silu, {}),
    "MishBackward0": lambda n: (F.mish, {}),
    "HardswishBackward0": lambda n: (F.hardswish, {}),
    "HardsigmoidBackward0": lambda n: (F.hardsigmoid, {}),
    "LeakyReluBackward0": lambda n: (F.leaky_relu, {"negative_slope": n._saved_negative_slope}),
    "SoftplusBackward0": lambda n: (F.softplus, {"beta": n._saved_beta, "threshold": n._saved_threshold}),
}


@dataclasses.dataclass(frozen=True)
class ActivationPolicy:
    """What compress_activations does with each saved tensor. Strings are accepted for enums."""

    linear: Granularity = Granularity.TENSOR
    """Inputs of linear/matmul/conv: per-tensor scaled, as COAT (FP8-GEMM ready). With power-of-two
    scales, per-tensor and per-group ("group") codes differ only for values more than 2**14.8 below
    the tensor's maximum (E4M3's normal range): the test models' gradients are the same to 6
    digits either way. Over three seeds each, the training-parity run (benchmarks/training_parity.py)
    ended +0.36/+2.76/+2.16% from AdamW per tensor and +0.70/+0.92/-1.26% per group, in a run whose
    final loss moves by about 1% with the seed alone: not enough to tell the two apart."""
    norm: Granularity = Granularity.BF16
    """Inputs of LayerNorm/RMSNorm/...: bfloat16, not COAT's per-group FP8 ("group"). A norm's
    backward feeds every gradient below it, and its weight gradient is a sum that cancels: with
    FP8 norm inputs the README's d=128 GPT had LayerNorm weight gradients at cosine 0.984 at
    step 6 and ended 3.8% above uncompressed after 150 steps (bf16: 0.9997 and -0.2%). Under
    bf16 autocast the residual stream a norm reads is float32, so this still halves it."""
    activation: Granularity = Granularity.GROUP
    """Inputs/outputs saved by GELU/SiLU/softmax/...: per-group, as COAT."""
    attention: Granularity = Granularity.GROUP
    """q and k saved by scaled_dot_product_attention (its logsumexp is always kept)."""
    attention_v_out: Granularity = Granularity.KEEP
    """v and the output saved by attention: kept by default. Backward forms dP - rowsum(dO * O)
    from them, a difference that cancels: compressing them ("group") took the Llama-style test
    model's min per-parameter gradient cosine from 0.9991 to 0.9980 (attention wk), below 0.999.
    Where q, k and v are views of one qkv projection (GPT-2 style), they share one storage region,
    packed once with q's granularity (the first save decides): there v is compressed (min cosine
    0.9992 on the GPT-style test model)."""
    loss: Granularity = Granularity.KEEP
    """Log-probabilities saved by cross_entropy: kept, FP8 log-probs would distort exp() badly."""
    other: Granularity = Granularity.GROUP
    """Everything else (elementwise products of SwiGLU and RoPE, ...)."""
    compiled: Granularity = Granularity.GROUP
    """16-bit tensors that a torch.compile'd graph saves (entered outside the compiled call): the
    op that made them is not visible at run time, so one granularity serves them all (matmul and
    attention inputs, activation-function inputs)."""
    compiled_fp32: Granularity = Granularity.KEEP
    """float32 tensors a compiled graph saves: kept by default. Under autocast these are the
    residual stream that norms read, norm statistics and attention's logsumexp, which cannot be
    told apart at run time; the logsumexp does not survive even bfloat16 (backward takes exp of
    scores minus it). Without autocast everything is float32: choose "bf16" or "group" there."""
    fmt: FP8Format = FP8Format.E4M3
    """FP8 format of the codes."""
    group_size: int = 16
    """Elements per group along the last dim for GROUP (a power of two; 16 as COAT)."""
    min_numel: int = 2**16
    """Tensors with fewer elements are kept: below that, launches cost more than the bytes saved."""
    backend: str = "auto"
    """'auto' (Triton kernels on CUDA, pure torch elsewhere), 'torch' or 'triton'."""
    recompute: bool = True
    """Outputs of activation functions (GELU, SiLU, ...) whose input the same call saved compressed
    are not stored again when a later op saves them: backward recomputes them from that input."""

    def __post_init__(self) -> None:
        for name in [k.value for k in OpKind] + ["attention_v_out", "compiled", "compiled_fp32"]:
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, Granularity(value))
            except ValueError:
                raise ValueError(
                    f"{name}={value!r} is not a granularity: use 'keep', 'tensor' or 'group'"
                ) from None
        object.__setattr__(self, "fmt", FP8Format.parse(self.fmt))
        g = self.group_size
        if not isinstance(g, int) or g < 1 or g & (g - 1) or g > 1024:
            raise ValueError(f"group_size must be a power of two in [1, 1024]; got {g!r}")
        if not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"min_numel must be a non-negative int; got {self.min_numel!r}")
        if not isinstance(self.recompute, bool):
            raise ValueError(f"recompute must be True or False; got {self.recompute!r}")
        if self.backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton'; got {self.backend!r}")

    def granularity(self, kind: OpKind) -> Granularity:
        return getattr(self, kind.value)

    @classmethod
    def resolve(cls, policy: ActivationPolicy | None, overrides: dict) -> ActivationPolicy:
        """`policy` (default: ActivationPolicy()) with keyword overrides, checked by name."""
        policy = policy if policy is not None else cls()
        if not isinstance(policy, cls):
            raise TypeError(f"policy must be an ActivationPolicy; got {type(policy).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; ActivationPolicy fields are {sorted(fields)}")
        return dataclasses.replace(policy, **overrides)


KEPT_NOT_ACTIVATION = (
    "parameter or other leaf requiring grad",
    "created before the context",
    "parameter cast or view",
    "input of a compiled graph",
)
"""Reasons for keeping a tensor that stays alive anyway: they are not activation memory."""


KEEP_ALL = {
    f.name: Granularity.KEEP
    for f in dataclasses.fields(ActivationPolicy)
    if isinstance(getattr(ActivationPolicy(), f.name), Granularity)
}
"""Overrides for a policy that compresses nothing, `compress_activations(**KEEP_ALL)`: the
uncompressed baseline, counted by the same ActivationStats."""


@dataclasses.dataclass
class ActivationStats:
    """What a compress_activations context did (counts and bytes at pack time)."""

    packed: int = 0
    """Tensors compressed."""
    shared: int = 0
    """Saves answered by an earlier save of the same memory (compressed or kept once)."""
    kept: int = 0
    """Tensors held uncompressed (see kept_reasons)."""
    recomputed: int = 0
    """Activation-function outputs recomputed in backward from their held input instead of held."""
    bytes_original: int = 0
    """Bytes the compressed regions had."""
    bytes_packed: int = 0
    """Bytes they take packed (codes and scale bytes)."""
    bytes_recomputed: int = 0
    """Bytes the recomputed outputs had (they hold none)."""
    bytes_kept: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Bytes kept, by reason."""
    kept_reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Count of kept tensors, by reason."""
    packed_by_kind: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Count of compressed tensors, by 'kind/granularity'."""

    @property
    def bytes_kept_activations(self) -> int:
        """Kept bytes that are activations (not parameters, buffers, inputs held anyway)."""
        return sum(v for k, v in self.bytes_kept.items() if k not in KEPT_NOT_ACTIVATION)

    @property
    def activation_bytes_original(self) -> int:
        return self.bytes_original + self.bytes_recomputed + self.bytes_kept_activations

    @property
    def activation_bytes_held(self) -> int:
        return self.bytes_packed + self.bytes_kept_activations

    @property
    def ratio(self) -> float:
        """Saved activation bytes without compression / with it (>= 1; 1.0 when nothing saved)."""
        held = self.activation_bytes_held
        return self.activation_bytes_original / held if held else 1.0

    def summary(self) -> str:
        mib = 2.0**20
        lines = [
            f"compressed {self.packed} tensors: {self.bytes_original / mib:.2f} MiB -> "
            f"{self.bytes_packed / mib:.2f} MiB; {self.shared} saves shared an earlier one; "
            f"{self.recomputed} outputs ({self.bytes_recomputed / mib:.2f} MiB) recomputed in backward",
            f"saved activations {self.activation_bytes_original / mib:.2f} MiB -> "
            f"{self.activation_bytes_held / mib:.2f} MiB held ({self.ratio:.2f}x smaller)",
        ]
        for reason, count in sorted(self.kept_reasons.items()):
            lines.append(f"kept {count} ({self.bytes_kept[reason] / mib:.2f} MiB): {reason}")
        return "\n".join(lines)


# -- the held format: pure-torch codec (twin of kernels/activation_pack.py) -------------------
NAN_SCALE = 255
"""Scale byte of a tensor or group whose max|x| is NaN or Inf: it unpacks to NaN."""
MIN_SCALE_EXPONENT = -126
"""Smallest scale exponent (scales stay normal float32 numbers)."""


def _abs_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 bits of |x| as int32: integer order is |x|'s order, NaN above Inf."""
    return x.float().view(torch.int32) & 0x7FFFFFFF


def _scale_exponent(amax_bits: torch.Tensor, fmt: FP8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """(e, scale byte): the smallest e >= -126 with max|x| <= FP8_MAX * 2**e (nothing saturates)."""
    emax = int(fmt.max).bit_length() - 1  # FP8_MAX = 1.75 * 2**emax for both formats
    mmax = int((fmt.max / 2**emax - 1) * 2**23)
    raw = amax_bits >> 23
    e = (raw - (127 + emax) + ((amax_bits & 0x7FFFFF) > mmax).int()).clamp(min=MIN_SCALE_EXPONENT)
    return e, torch.where(raw == 255, NAN_SCALE, e + 127).to(torch.uint8)


def _encode(x: torch.Tensor, e: torch.Tensor, byte: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    inv = ((127 - e) << 23).view(torch.float32)  # 2**-e exactly
    y = torch.where(byte == NAN_SCALE, 0.0, x.float() * inv)  # the NaN scale byte marks the group
    return round_to_fp8_grid(y, fmt).to(fmt.dtype)


def _decode(codes: torch.Tensor, byte: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    scale = (byte.int() << 23).view(torch.float32)  # 2**(byte - 127) exactly
    scale = torch.where(byte == NAN_SCALE, torch.nan, scale)
    big = torch.finfo(dtype).max
    return (codes.float() * scale).clamp(-big, big).to(dtype)


def pack_tensor(x: torch.Tensor, fmt: FP8Format | str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in x's shape, scale byte (1,) uint8): x ~= codes * 2**(scale - 127)."""
    fmt = FP8Format.parse(fmt)
    amax = _abs_bits(x).amax().reshape(1) if x.numel() else torch.zeros(1, dtype=torch.int32, device=x.device)
    e, byte = _scale_exponent(amax, fmt)
    return _encode(x, e, byte, fmt), byte


def unpack_tensor(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of pack_tensor, in `dtype`."""
    return _decode(codes, scale, dtype)


def _as_groups(x2d: torch.Tensor, group_size: int) -> torch.Tensor:
    """(rows, cols) -> (rows, groups, group_size), zero-padded at the end of each row."""
    rows, cols = x2d.shape
    pad = -cols % group_size
    if pad or cols == 0:
        x2d = torch.nn.functional.pad(x2d, (0, pad if cols else group_size))
    return x2d.reshape(rows, max(1, -(-cols // group_size)), group_size)


def pack_groups(x2d: torch.Tensor, group_size: int = 16, fmt: FP8Format | str = "e4m3"):
    """(codes (rows, cols), scale bytes (rows, groups_per_row) uint8) of a 2-D tensor."""
    fmt = FP8Format.parse(fmt)
    rows, cols = x2d.shape
    x = _as_groups(x2d, group_size)
    e, byte = _scale_exponent(_abs_bits(x).amax(dim=-1), fmt)
    codes = _encode(x, e.unsqueeze(-1), byte.unsqueeze(-1), fmt)
    return codes.reshape(rows, x.shape[1] * group_size)[:, :cols], byte


def unpack_groups(codes2d: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype):
    """The inverse of pack_groups, in `dtype`."""
    rows, cols = codes2d.shape
    x = _decode(_as_groups(codes2d.float(), group_size), scales.unsqueeze(-1), dtype)
    return x.reshape(rows, x.shape[1] * group_size)[:, :cols]
