"""Triton kernels that pack saved activations into FP8 and unpack them for backward.

Twin (the CPU path and the oracle): coatstate.formats.activation's `pack_tensor`,
`pack_groups`, ... (docs/FORMAT.md, "Saved activations").

Scales are powers of two stored as one byte (E8M0, as in the MX formats): byte b means 2**(b-127),
b = 255 marks a group (or tensor) whose maximum was NaN or Inf. The exponent comes from the
integer bits of max|x|, so there is no division anywhere: the smallest e with
max|x| <= FP8_MAX * 2**e (nothing saturates), clamped to e >= -126. Multiplying by 2**-e and
by 2**e is exact in float32, so kernels and twin agree bit for bit on any device, also under
TRITON_INTERPRET=1 (there the kernel rounds onto the FP8 grid in float32 before the cast, as the
twin does; on the GPU the float8 conversion instruction rounds to nearest even by itself).

The maximum is taken over the float32 bits of |x| as int32 (sign bit cleared): for non-negative
floats integer order is float order, and NaN (bits above Inf's) wins, so it propagates.

Per tensor, two launches and two passes over the data: `_amax_kernel` atomically maxes each
program's maximum into one zeroed int32 slot; `_pack_tensor_kernel` reads it, derives the scale
and writes the codes (program 0 also writes the scale byte into its slot). No host sync: the
scale stays on the device.

Per group, one pass: the tensor is (rows, cols) and each row is cut into groups of G (the last
group of a row may be shorter; a group never crosses a row). A program takes BLOCK_GROUPS groups
as a [BLOCK_GROUPS, G] tile (fp8_triton.group_offsets; rows that are whole groups load as
contiguous runs), reduces each group's maximum and writes codes and scale bytes (rows, groups).

Host cost matters as much as bandwidth here (one pack per saved tensor in forward, one unpack
per tensor in backward, each a kernel launch from Python): the `*_flat` launchers below, which
compress_activations calls, take flat buffers and slots instead of checking and allocating
several tensors; codes are stored as uint8 bits, with per-group scale bytes in the same buffer
after the codes; and `_Launcher` reuses the compiled kernel for a known specialization instead of
going through triton's argument binding on every call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.compiler.compiler import CompiledKernel

from ..formats.fp8 import FLOAT_DTYPES, FP8Format
from .fp8_triton import FAST_MATH, cdiv, check_float_input, from_fp8_bits, group_offsets, round_to_fp8_grid

_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU builds
_BLOCK = 4096  # elements per program of the per-tensor kernels
_AMAX_ITERS = 4  # blocks per program of the amax kernel: fewer atomics on one address
_GROUP_TILE = 4096  # elements per program of the per-group kernels
NAN_SCALE = tl.constexpr(255)
"""Scale byte of a tensor or group whose maximum is NaN or Inf (it unpacks to NaN)."""
MIN_EXPONENT = tl.constexpr(-126)
"""Smallest scale exponent: scales stay normal float32 numbers."""


def scale_constants(fmt: FP8Format) -> dict:
    """constexpr arguments: FP8_MAX = (1 + MMAX / 2**23) * 2**EMAX."""
    emax = int(fmt.max).bit_length() - 1
    return {"EMAX": emax, "MMAX": int((fmt.max / 2**emax - 1) * 2**23)}


@triton.jit
def _abs_bits(x):
    """float32 bits of |x| as int32: ordered as |x|, NaN above Inf."""
    return x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _scale_exponent(amax_bits, EMAX: tl.constexpr, MMAX: tl.constexpr):
    """(e, scale byte) of a maximum given as _abs_bits: smallest e >= -126 with amax <= FP8_MAX * 2**e."""
    raw = amax_bits >> 23
    e = raw - (127 + EMAX) + ((amax_bits & 0x7FFFFF) > MMAX).to(tl.int32)
    e = tl.maximum(e, MIN_EXPONENT)
    return e, tl.where(raw == 255, NAN_SCALE, e + 127)


@triton.jit
def _encode(x, e, byte, FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr):
    """FP8-grid values of x * 2**-e (float32); 0 in a NAN_SCALE group (the scale makes it NaN)."""
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    y = tl.where(byte == NAN_SCALE, 0.0, x.to(tl.float32) * inv)
    if FAST_MATH:  # the GPU's conversion rounds to nearest even itself (|y| <= FP8_MAX already)
        return y
    else:  # Triton's interpreter truncates instead: put y on the grid first
        return round_to_fp8_grid(y, FP8_MAX, MANT, EMIN)


@triton.jit
def _decode(q, byte, OUT_MAX: tl.constexpr, BF16: tl.constexpr):
    """q * 2**(byte - 127) in float32 (NaN for NAN_SCALE), clamped to the output dtype's range and,
    for bfloat16, rounded to it in integer arithmetic so that the cast is exact (the interpreter's
    own cast truncates)."""
    scale = (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    scale = tl.where(byte == NAN_SCALE, float("nan"), scale)
    x = q.to(tl.float32) * scale
    x = tl.minimum(
        tl.maximum(x, -OUT_MAX, propagate_nan=tl.PropagateNan.ALL), OUT_MAX, propagate_nan=tl.PropagateNan.ALL
    )
    if BF16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, slot, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.static_range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        acc = tl.maximum(acc, _abs_bits(tl.load(x_ptr + offs, mask=offs < n, other=0.0)))
    tl.atomic_max(amax_ptr + slot, tl.max(acc, axis=0))


@triton.jit
def _to_bits(q, IS_E4M3: tl.constexpr):
    if IS_E4M3:
        return q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return q.to(tl.float8e5).to(tl.uint8, bitcast=True)


@triton.jit
def _pack_tensor_kernel(
    x_ptr,
    amax_ptr,
    codes_ptr,
    scale_ptr,
    slot,
    n,
    FP8_MAX: tl.constexpr,
    MANT: tl.constexpr,
    EMIN: tl.constexpr,
    EMAX: tl.constexpr,
    MMAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    e, byte = _scale_exponent(tl.load(amax_ptr + slot), EMAX, MMAX)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    q = _encode(x, e, byte, FP8_MAX, MANT, EMIN)
    tl.store(codes_ptr + offs, _to_bits(q, IS_E4M3), mask=mask)
    if pid == 0:
        tl.store(scale_ptr + slot, byte.to(tl.uint8))


@triton.jit
def _unpack_tensor_kernel(
    codes_ptr,
    scale_ptr,
    out_ptr,
    slot,
    n,
    OUT_MAX: tl.constexpr,
    BF16: tl.constexpr,
    IS_E4M3: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    q = from_fp8_bits(tl.load(codes_ptr + offs, mask=mask, other=0), IS_E4M3)
    x = _decode(q, tl.load(scale_ptr + slot), OUT_MAX, BF16)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _pack_groups_kernel(
    x_ptr,
    buf_ptr,
    n,
    n_groups,
    cols,
    groups_per_row,
    FP8_MAX: tl.constexpr,
    MANT: tl.constexpr,
    EMIN: tl.constexpr,
    EMAX: tl.constexpr,
    MMAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    G: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """buf: n code bytes, then n_groups scale bytes."""
    gid = tl.program_id(0).to(tl.int64) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    offs, mask = group_offsets(gid, n_groups, cols, groups_per_row, G, EVEN)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    e, byte = _scale_exponent(tl.max(_abs_bits(x), axis=1), EMAX, MMAX)
    q = _encode(x, e[:, None], byte[:, None], FP8_MAX, MANT, EMIN)
    tl.store(buf_ptr + offs, _to_bits(q, IS_E4M3), mask=mask)
    tl.store(buf_ptr + n + gid, byte.to(tl.uint8), mask=gid < n_groups)


@triton.jit
def _unpack_groups_kernel(
    buf_ptr,
    out_ptr,
    n,
    n_groups,
    cols,
    groups_per_row,
    OUT_MAX: tl.constexpr,
    BF16: tl.constexpr,
    IS_E4M3: tl.constexpr,
    G: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    gid = tl.program_id(0).to(tl.int64) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    offs, mask = group_offsets(gid, n_groups, cols, groups_per_row, G, EVEN)
    q = from_fp8_bits(tl.load(buf_ptr + offs, mask=mask, other=0), IS_E4M3)
    byte = tl.load(buf_ptr + n + gid, mask=gid < n_groups, other=0)
    x = _decode(q, byte[:, None], OUT_MAX, BF16)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


class _Launcher:
    """`kernel[grid](*args, **constexprs)`, reusing the compiled kernel once triton has compiled it
    for a specialization: triton specializes integer arguments on (== 1, % 16 == 0, 64-bit) and
    pointers on 16-byte alignment, so that, the device and the constexprs form the key here.

    Reuse goes through the compiled kernel's own launcher with the current stream (`mode` 2) or,
    if that call does not fit this triton version, through CompiledKernel[grid] (`mode` 1), else
    through triton's full launch (`mode` 0): a mismatch raises TypeError (triton's launcher checks
    its argument count) and moves every launcher one mode down.

    The `*_flat` functions below call `run` with keys of their own, built without a loop over the
    arguments (microseconds per launch): a `_Plan` per shape fixes the constexprs and the integer
    arguments, so its interned `_Spec` stands for them, next to the tensors' dtypes and alignment
    (and the slot's specialization). Such a key determines what `key` would give for the launch."""

    mode = 2

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.compiled: dict[tuple, CompiledKernel] = {}

    @staticmethod
    def key(args: tuple, constexprs: dict) -> tuple:
        key = [args[0].get_device(), *constexprs.values()]
        for a in args:
            if type(a) is int:
                key += _int_spec(a)
            else:
                key += (a.dtype, a.data_ptr() % 16 == 0)
        return tuple(key)

    def __call__(self, grid: tuple[int, ...], args: tuple, constexprs: dict) -> None:
        self.run(self.key(args, constexprs), grid, args, constexprs)

    def run(self, key: tuple, grid: tuple[int, ...], args: tuple, constexprs: dict) -> None:
        """Launch with `key`: `key(args, constexprs)` or one that determines it (see the class
        docstring); its first item is the device."""
        compiled = self.compiled.get(key) if _Launcher.mode else None
        if compiled is not None:
            try:
                self.launch(compiled, key[0], grid, args, constexprs)
                return
            except (TypeError, AttributeError):
                _Launcher.mode -= 1
                return self(grid, args, constexprs)
        compiled = self.compile(grid, args, constexprs)
        if isinstance(compiled, CompiledKernel) and _Launcher.mode:
            self.compiled[key] = compiled

    def launch(
        self, compiled: CompiledKernel, device: int, grid: tuple, args: tuple, constexprs: dict
    ) -> None:
        """Launch an already compiled kernel (the path of every call after the first)."""
        if _Launcher.mode == 2:
            g = (*grid, 1, 1)
            stream = _current_stream(device)
            compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,
                         None, None, None, *args, *constexprs.values())  # fmt: skip
        else:
            compiled[(*grid, 1, 1)[:3]](*args, *constexprs.values())

    def compile(self, grid: tuple, args: tuple, constexprs: dict):
        """triton's full launch, which compiles the kernel for a new specialization."""
        return self.kernel[grid](*args, **constexprs, num_warps=8)


def _int_spec(a: int) -> tuple[bool, bool, bool]:
    """What triton specializes an integer argument on."""
    return (a == 1, a % 16 == 0, a >= 2**31)


_amax = _Launcher(_amax_kernel)
_pack_tensor = _Launcher(_pack_tensor_kernel)
_unpack_tensor = _Launcher(_unpack_tensor_kernel)
_pack_groups = _Launcher(_pack_groups_kernel)
_unpack_groups = _Launcher(_unpack_groups_kernel)
_CONSTANTS: dict = {}
_AMAX_CONSTANTS = {"BLOCK": _BLOCK, "ITERS": _AMAX_ITERS}
_U8 = torch.uint8
_PLANS: dict = {}  # (what, n, ...) -> _Plan: one per shape and format seen
_SPECS: dict = {}  # items -> _Spec: one per specialization seen (few: they differ by format, dtype, ...)
_MAX_PLANS = 4096  # (a run with ever new shapes starts over rather than grow without bound)


def _encode_constants(fmt: FP8Format, **extra) -> dict:
    """constexprs of a pack kernel (cached: the launchers' keys are built from them per call)."""
    key = (fmt, *extra.items())
    const = _CONSTANTS.get(key)
    if const is None:
        const = _CONSTANTS[key] = {
            "FP8_MAX": fmt.max,
            "MANT": fmt.mantissa_bits,
            "EMIN": fmt.min_normal_exponent,
            **scale_constants(fmt),
            "IS_E4M3": fmt is FP8Format.E4M3,
            **extra,
        }
    return const


def _decode_constants(fmt: FP8Format, dtype: torch.dtype, **extra) -> dict:
    key = (fmt, dtype, *extra.items())
    const = _CONSTANTS.get(key)
    if const is None:
        const = _CONSTANTS[key] = {
            "OUT_MAX": float(torch.finfo(dtype).max),
            "BF16": dtype == torch.bfloat16,
            "IS_E4M3": fmt is FP8Format.E4M3,
            **extra,
        }
    return const


class _Spec:
    """The constexpr values and integer specializations a _Plan fixes, interned: in a launch key it
    hashes and compares as one object instead of some twenty items."""

    __slots__ = ("items",)

    def __init__(self, items: tuple) -> None:
        self.items = items


def _spec(const: dict, *ints: int) -> _Spec:
    items = (*const.values(), *(b for a in ints for b in _int_spec(a)))
    spec = _SPECS.get(items)
    if spec is None:
        spec = _SPECS[items] = _Spec(items)
    return spec


class _Plan:
    """What a flat launch derives from its sizes and formats alone, worked out once per shape:
    grids, integer arguments, constexprs, and the _Spec of the latter two (`spec2`: of the amax
    launch of a per-tensor pack)."""

    __slots__ = ("grid", "grid2", "n_groups", "cols", "per_row", "const", "spec", "spec2")

    def __init__(self, grid, const, spec, grid2=None, spec2=None, n_groups=0, cols=0, per_row=0) -> None:
        self.grid, self.grid2, self.const, self.spec, self.spec2 = grid, grid2, const, spec, spec2
        self.n_groups, self.cols, self.per_row = n_groups, cols, per_row


def _plan(key: tuple) -> _Plan:
    """_PLANS[key], made on first use (key: (what, n, fmt, ...) as the functions below pass it)."""
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    what, n, fmt = key[:3]
    if what == "tensor":  # (n, fmt, dtype or None): two grids (amax, then pack) or one (unpack)
        dtype = key[3]
        if dtype is None:
            const = _encode_constants(fmt, BLOCK=_BLOCK)
        else:
            const = _decode_constants(fmt, dtype, BLOCK=_BLOCK)
        grid, grid2 = (max(1, cdiv(n, _BLOCK)),), (max(1, cdiv(n, _BLOCK * _AMAX_ITERS)),)
        plan = _Plan(grid, const, _spec(const, n), grid2=grid2, spec2=_spec(_AMAX_CONSTANTS, n))
    else:  # "groups": (n, fmt, cols, group_size, dtype or None)
        cols, group_size, dtype = key[3:]
        n_groups, cols, per_row, even, block = _group_layout(n, cols, group_size)
        if dtype is None:
            const = _encode_constants(fmt, G=group_size, EVEN=even, BLOCK_GROUPS=block)
        else:
            const = _decode_constants(fmt, dtype, G=group_size, EVEN=even, BLOCK_GROUPS=block)
        spec = _spec(const, n, n_groups, cols, per_row)
        plan = _Plan((cdiv(n_groups, block),), const, spec, n_groups=n_groups, cols=cols, per_row=per_row)
    _PLANS[key] = plan
    return plan


def pack_tensor_flat(x, n: int, fmt: FP8Format, amax, scales, slot: int) -> torch.Tensor:
    """Codes (n,) uint8 of the n elements at x's data pointer (dense); the scale byte goes to
    scales[slot], the maximum through amax[slot] (int32, zero before the call)."""
    plan = _PLANS.get(("tensor", n, fmt, None))
    if plan is None:
        plan = _plan(("tensor", n, fmt, None))
    codes = x.new_empty(n, dtype=_U8)
    device = x.get_device()
    xa = (x.dtype, x.data_ptr() % 16 == 0, amax.dtype, amax.data_ptr() % 16 == 0, slot == 1, slot % 16 == 0,
          slot >= 2**31)  # fmt: skip
    _amax.run((device, plan.spec2, *xa), plan.grid2, (x, amax, slot, n), _AMAX_CONSTANTS)
    key = (device, plan.spec, *xa, codes.data_ptr() % 16 == 0, scales.dtype, scales.data_ptr() % 16 == 0)
    _pack_tensor.run(key, plan.grid, (x, amax, codes, scales, slot, n), plan.const)
    return codes


def unpack_tensor_flat(
    codes, scales, slot: int, fmt: FP8Format, dtype: torch.dtype, out=None
) -> torch.Tensor:
    """The (n,) tensor in `dtype` from pack_tensor_flat's codes and scales[slot]; or written into
    `out`, a tensor in `dtype` whose n elements are dense from its data pointer on (any shape)."""
    n = codes.numel()
    plan = _PLANS.get(("tensor", n, fmt, dtype))
    if plan is None:
        plan = _plan(("tensor", n, fmt, dtype))
    if out is None:
        out = codes.new_empty(n, dtype=dtype)
    key = (codes.get_device(), plan.spec, codes.dtype, codes.data_ptr() % 16 == 0, scales.dtype,
           scales.data_ptr() % 16 == 0, out.dtype, out.data_ptr() % 16 == 0,
           slot == 1, slot % 16 == 0, slot >= 2**31)  # fmt: skip
    _unpack_tensor.run(key, plan.grid, (codes, scales, out, slot, n), plan.const)
    return out


def _group_layout(n: int, cols: int, group_size: int) -> tuple[int, int, int, bool, int]:
    if group_size < 1 or group_size & (group_size - 1) or group_size > 1024:
        raise ValueError(f"group_size must be a power of two in [1, 1024] for the kernel; got {group_size}")
    rows = n // cols if cols else 0
    groups_per_row = max(1, cdiv(cols, group_size))
    return (
        rows * groups_per_row,
        cols,
        groups_per_row,
        cols % group_size == 0,
        max(1, _GROUP_TILE // group_size),
    )


def pack_groups_flat(x, n: int, cols: int, group_size: int, fmt: FP8Format) -> torch.Tensor:
    """uint8 buffer: the codes of the n elements at x's data pointer (dense, rows of `cols`), then
    the scale bytes of their groups (rows, groups_per_row)."""
    plan = _PLANS.get(("groups", n, fmt, cols, group_size, None))
    if plan is None:
        plan = _plan(("groups", n, fmt, cols, group_size, None))
    buf = x.new_empty(n + plan.n_groups, dtype=_U8)
    if plan.n_groups:
        key = (x.get_device(), plan.spec, x.dtype, x.data_ptr() % 16 == 0, buf.data_ptr() % 16 == 0)
        _pack_groups.run(key, plan.grid, (x, buf, n, plan.n_groups, plan.cols, plan.per_row), plan.const)
    return buf


def unpack_groups_flat(buf, n: int, cols: int, group_size: int, fmt: FP8Format, dtype: torch.dtype, out=None):
    """The (n,) tensor in `dtype` from pack_groups_flat's buffer (or into `out`, as unpack_tensor_flat)."""
    plan = _PLANS.get(("groups", n, fmt, cols, group_size, dtype))
    if plan is None:
        plan = _plan(("groups", n, fmt, cols, group_size, dtype))
    if out is None:
        out = buf.new_empty(n, dtype=dtype)
    if plan.n_groups:
        key = (buf.get_device(), plan.spec, buf.dtype, buf.data_ptr() % 16 == 0, out.dtype,
               out.data_ptr() % 16 == 0)  # fmt: skip
        _unpack_groups.run(key, plan.grid, (buf, out, n, plan.n_groups, plan.cols, plan.per_row), plan.const)
    return out


# -- checked API on tensors (tests, other callers) -----------------------------------------
def _check_unpack(name: str, codes: torch.Tensor, dtype: torch.dtype) -> FP8Format:
    if not codes.is_contiguous():
        raise ValueError(f"{name} must be contiguous; got strides {codes.stride()}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32, bfloat16 or float16; got {dtype}")
    return FP8Format.parse(codes.dtype)  # raises for a non-FP8 dtype


def pack_tensor(x: torch.Tensor, fmt: FP8Format | str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in x's shape, scale byte (1,) uint8): x ~= codes * 2**(scale - 127)."""
    check_float_input("x", x)
    fmt = FP8Format.parse(fmt)
    amax = torch.zeros(1, dtype=torch.int32, device=x.device)
    scale = torch.empty(1, dtype=torch.uint8, device=x.device)
    codes = pack_tensor_flat(x, x.numel(), fmt, amax, scale, 0)
    return codes.view(fmt.dtype).view(x.shape), scale


def unpack_tensor(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes * 2**(scale - 127) in `dtype` (codes and scale as returned by pack_tensor)."""
    fmt = _check_unpack("codes", codes, dtype)
    if scale.dtype != torch.uint8 or scale.numel() != 1:
        raise ValueError(f"scale must be one uint8 exponent byte; got {scale.dtype} {tuple(scale.shape)}")
    out = unpack_tensor_flat(codes.reshape(-1).view(torch.uint8), scale, 0, fmt, dtype)
    return out.view(codes.shape)


def pack_groups(x2d: torch.Tensor, group_size: int = 16, fmt: FP8Format | str = "e4m3"):
    """(codes (rows, cols), scale bytes (rows, groups_per_row) uint8) of a contiguous 2-D tensor."""
    check_float_input("x2d", x2d)
    if x2d.dim() != 2:
        raise ValueError(f"x2d must be 2-D (rows, row_length); got shape {tuple(x2d.shape)}")
    fmt = FP8Format.parse(fmt)
    rows, cols = x2d.shape
    n = x2d.numel()
    buf = pack_groups_flat(x2d, n, cols, group_size, fmt)
    per_row = max(1, cdiv(cols, group_size))
    scales = (
        buf[n:].view(rows, per_row)
        if n
        else torch.full((rows, per_row), MIN_EXPONENT.value + 127, dtype=torch.uint8, device=x2d.device)
    )
    return buf[:n].view(fmt.dtype).view(rows, cols), scales


def unpack_groups(codes2d: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype):
    """The float tensor (rows, cols) in `dtype` from pack_groups' codes and scale bytes."""
    fmt = _check_unpack("codes2d", codes2d, dtype)
    if codes2d.dim() != 2:
        raise ValueError(f"codes2d must be 2-D; got shape {tuple(codes2d.shape)}")
    rows, cols = codes2d.shape
    want = (rows, max(1, cdiv(cols, group_size)))
    if tuple(scales.shape) != want or scales.dtype != torch.uint8:
        raise ValueError(
            f"scales must be uint8 exponent bytes of shape {want}; got {scales.dtype} {tuple(scales.shape)}"
        )
    n = codes2d.numel()
    buf = torch.cat([codes2d.reshape(-1).view(torch.uint8), scales.reshape(-1)])
    return unpack_groups_flat(buf, n, cols, group_size, fmt, dtype).view(rows, cols)
