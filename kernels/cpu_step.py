"""The CPU AdamW step over compressed moments: kernels/cpu_step.cpp, built at run time, and its launcher.

The kernel is one pass per group: decode the moments, update, encode, write the parameter (and
its master correction). It computes coatstate.optim.reference_step's bits exactly; the tests
hold it to that on random inputs for every format. It is plain C++ with OpenMP and no torch
headers, compiled once per machine with the C++ compiler torch.compile uses (`CXX`, else g++)
and cached on disk beside inductor's cache; a warm process loads it in milliseconds.

`adamw_step` returns None for what it does not cover (a float16 or float64 parameter, a 4-bit
AMSGrad maximum, uncompressed moments, a machine without a compiler): the caller then runs the
pure-torch twin, which stays the oracle. Without a compiler that is said once, with the fix.
"""

from __future__ import annotations

import ctypes
import functools
import getpass
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ..formats import group as _group
from ..formats.fp4_moment import ROUNDING_STREAM, FP4Format
from ..formats.fp8 import FP8Format
from ..formats.optimizer_state import CODES, EXPONENTS, MASTER_CORRECTION, SCALES, MomentFormat

logger = logging.getLogger("coatstate")

SOURCE = Path(__file__).with_name("cpu_step.cpp")
HEADERS = (Path(__file__).with_name("cpu_codec.h"),)
FLAGS = (
    "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
    # bits: no a*b+c contracted into an FMA; no errno or trap semantics, which stop vectorization
    "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
    # gcc's jump threading splits the codec's selects into branches, which do not vectorize
    "-fno-thread-jumps",
) + (("-mprefer-vector-width=512",) if os.uname().machine == "x86_64" else ())  # fmt: skip
_KINDS = {FP8Format.E4M3: 1, FP8Format.E5M2: 2, FP4Format.E2M1: 3, FP4Format.UE3M1_SQRT: 4}
_MASK32 = 0xFFFFFFFF


class _Moment(ctypes.Structure):
    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("exponents", ctypes.c_void_p),
        ("kind", ctypes.c_int32),
        ("second", ctypes.c_int32),
        ("scale_max", ctypes.c_float),
        ("k_numerator", ctypes.c_float),
        ("log2_max", ctypes.c_float),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("param", ctypes.c_void_p),
        ("correction", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("m", _Moment),
        ("v", _Moment),
        ("vmax", _Moment),
        ("rows", ctypes.c_int64),
        ("cols", ctypes.c_int64),
        ("first_element", ctypes.c_int64),
        ("group_size", ctypes.c_int32),
        *[
            (name, ctypes.c_int32)
            for name in (
                "param_bf16",
                "grad_bf16",
                "master_bits",
                "amsgrad",
                "maximize",
                "has_inv_scale",
                "weight_decay",
                "fma_lerp",
                "fma_addcmul",
            )
        ],  # fmt: skip
        *[
            (name, ctypes.c_float)
            for name in (
                "decay",
                "lerp_weight",
                "beta2",
                "one_minus_beta2",
                "bc2_sqrt",
                "eps",
                "neg_step_size",
                "inv_scale",
            )
        ],  # fmt: skip
        ("master_key", ctypes.c_uint32),
        ("rounding_key", ctypes.c_uint32),
        ("bf16_nan", ctypes.c_uint16),
        ("threads", ctypes.c_int32),
        ("nonfinite", ctypes.c_int64),
    ]


def compiler() -> str | None:
    """The C++ compiler to build with: $CXX, else g++ or clang++ on PATH (None: none found)."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cache_dir() -> Path:
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"
    )
    return Path(root) / "coatstate_cpu_step"


def _machine_key() -> str:
    """What -march=native depends on: the CPU's feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return os.uname().machine


def build(cxx: str) -> Path:
    """Compile kernels/cpu_step.cpp with `cxx` (once per source, flags, compiler and CPU) and
    return the shared library's path; a CalledProcessError carries the compiler's message."""
    source = b"\0".join(path.read_bytes() for path in (SOURCE, *HEADERS))
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        b"\0".join([source, " ".join(FLAGS).encode(), version.encode(), _machine_key().encode()])
    )
    target = _cache_dir() / f"cpu_step_{key.hexdigest()[:20]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, check=True)
        os.replace(tmp, target)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def library() -> tuple[ctypes.CDLL, dict] | None:
    """The loaded kernel and how this machine's torch rounds (None: the twin runs instead)."""
    cxx = compiler()
    if cxx is None:
        logger.warning(
            "coatstate: no C++ compiler found, so CompressedAdamW's CPU step runs the slow pure-torch "
            "twin; install g++ (apt install g++) or point CXX at a compiler"
        )
        return None
    try:
        lib = ctypes.CDLL(str(build(cxx)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        logger.warning(
            "coatstate: building the CPU step with %s failed, so CompressedAdamW's CPU step runs the "
            "slow pure-torch twin (fix the compiler or set CXX to another one): %s",
            cxx,
            detail.strip().splitlines()[-1] if detail.strip() else e,
        )
        return None
    lib.coat_adamw_step.argtypes = [ctypes.POINTER(_Step)]
    rounding = _probe_rounding(lib)
    if rounding is None:
        logger.warning(
            "coatstate: torch's eager lerp/addcmul round in a way the CPU step does not know, so the "
            "pure-torch twin runs (please report your CPU and torch version)"
        )
        return None
    return lib, rounding


def _fused_or_plain(lib, a, b, c, eager) -> bool | None:
    """Whether `eager` (torch's a * b + c) rounds once (True), twice (False) or neither (None)."""
    n = a.numel()
    fused, plain = torch.empty(n), torch.empty(n)
    lib.coat_probe(
        *(ctypes.c_void_p(t.data_ptr()) for t in (a, b, c)), ctypes.c_int64(n),
        ctypes.c_void_p(fused.data_ptr()), ctypes.c_void_p(plain.data_ptr()),
    )  # fmt: skip
    if torch.equal(eager, fused):
        return True
    return False if torch.equal(eager, plain) else None


def _probe_rounding(lib) -> dict | None:
    lib.coat_probe.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 2
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 4099, generator=gen)  # an odd length: the vector body and its tail
    w = torch.full_like(x, 0.1)
    lerp = _fused_or_plain(lib, w, y - x, x, x.lerp(y, 0.1))
    value = torch.full_like(x, 1 - 0.999)
    base = x.abs() * 0.999
    addcmul = _fused_or_plain(lib, value * y, y, base, base.clone().addcmul_(y, y, value=1 - 0.999))
    if lerp is None or addcmul is None:
        return None
    nan_bits = torch.full((4099,), math.nan).to(torch.bfloat16).view(torch.int16)
    return {"fma_lerp": lerp, "fma_addcmul": addcmul, "bf16_nan": int(nan_bits[0]) & 0xFFFF}


def _key(seed: int, step: int, stream: int) -> int:
    """formats.master_weights.hash32's key for (seed, step, stream), as a uint32."""
    h = (seed * 0x9E3779B1 + step * 0x632BE5AB + stream) & _MASK32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def _moment(state: dict, name: str, fmt: MomentFormat, second: bool) -> _Moment:
    out = _Moment()
    out.codes = state[name + CODES].data_ptr()
    out.scales = state[name + SCALES].data_ptr()
    out.exponents = state[name + EXPONENTS].data_ptr() if fmt.expand else None
    out.kind, out.scale_max, out.k_numerator, out.log2_max = _format_constants(fmt.fmt)
    out.second = int(second)
    return out


@functools.cache
def _format_constants(fmt: FP8Format | FP4Format) -> tuple[int, float, float, float]:
    """(kind, largest plain-FP8 scale, 16 log2(expansion range), log2(FP8 max)) of a format."""
    if not isinstance(fmt, FP8Format):
        return _KINDS[fmt], 0.0, 0.0, 0.0
    scale_max = _group.FLOAT32_MAX / fmt.max * (1 - 2.0**-20)
    k_numerator = _group.EXPONENT_DENOMINATOR * math.log2(fmt.expansion_range)
    return _KINDS[fmt], scale_max, k_numerator, math.log2(fmt.max)


def _float32(x: float | torch.Tensor) -> float:
    """A scalar as the float32 torch's CPU kernels compute with: a tensor's value; a Python float
    as is, since a ctypes c_float field rounds it to nearest as torch does (torch.as_tensor would
    cost microseconds a call, several calls a parameter)."""
    return x.item() if isinstance(x, torch.Tensor) else x


def supports(param: torch.Tensor, grad: torch.Tensor, state: dict, formats: dict, amsgrad: bool) -> bool:
    """Whether adamw_step covers this parameter (else the twin steps it)."""
    m, v = formats["exp_avg"], formats["exp_avg_sq"]
    if m is None or v is None or param.device.type != "cpu" or grad.device != param.device:
        return False
    floats = (torch.float32, torch.bfloat16)
    if param.dtype not in floats or grad.dtype not in floats:
        return False
    if amsgrad and v.bits == 4:
        return False  # a 4-bit maximum rounds to nearest, which only the twin spells out
    tensors = [param, grad, *(t for k, t in state.items() if k != "step" and isinstance(t, torch.Tensor))]
    return grad.shape == param.shape and all(t.is_contiguous() for t in tensors)


def adamw_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    formats: dict,
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
    amsgrad: bool,
    step: float,
    inv_grad_scale: torch.Tensor | None = None,
    master_bits: int | None = None,
    seed: int = 0,
    first_element: int = 0,
) -> int | None:
    """One AdamW step of one parameter with compressed moments, as reference_step.adamw_step_reference
    computes it (same arguments). Returns the count of non-finite moment values, or None where
    this path does not apply (then nothing was changed)."""
    loaded = library()
    if loaded is None or not supports(param, grad, state, formats, amsgrad):
        return None
    lib, rounding = loaded
    fm, fv = formats["exp_avg"], formats["exp_avg_sq"]
    rows, cols, _ = _group.group_layout(tuple(param.shape), fm.group_size)
    a = _Step()
    a.param, a.grad = param.data_ptr(), grad.data_ptr()
    a.correction = state[MASTER_CORRECTION].data_ptr() if master_bits in (24, 32) else None
    a.m = _moment(state, "exp_avg", fm, False)
    a.v = _moment(state, "exp_avg_sq", fv, True)
    if amsgrad:
        a.vmax = _moment(state, "max_exp_avg_sq", formats["max_exp_avg_sq"], True)
    a.rows, a.cols, a.first_element, a.group_size = rows, cols, first_element, fm.group_size
    a.param_bf16 = param.dtype == torch.bfloat16
    a.grad_bf16 = grad.dtype == torch.bfloat16
    a.master_bits = master_bits or 0
    a.amsgrad, a.maximize = amsgrad, maximize
    a.has_inv_scale = inv_grad_scale is not None
    a.inv_scale = _float32(inv_grad_scale) if inv_grad_scale is not None else 1.0
    a.weight_decay = weight_decay != 0
    a.fma_lerp, a.fma_addcmul = rounding["fma_lerp"], rounding["fma_addcmul"]
    if isinstance(lr, torch.Tensor):  # the twin computes with a tensor lr in float32: so here
        lr = lr.detach().to("cpu").reshape(())
    a.decay = _float32(1 - lr * weight_decay)
    a.lerp_weight = _float32(1 - beta1)
    a.beta2, a.one_minus_beta2 = _float32(beta2), _float32(1 - beta2)
    a.bc2_sqrt = _float32((1 - beta2**step) ** 0.5)
    a.eps = _float32(eps)
    a.neg_step_size = _float32(-(lr / (1 - beta1**step)))
    a.master_key = _key(seed, int(step), 0)
    a.rounding_key = _key(seed, int(step), ROUNDING_STREAM)
    a.bf16_nan = rounding["bf16_nan"]
    a.threads = torch.get_num_threads()
    lib.coat_adamw_step(ctypes.byref(a))
    return int(a.nonfinite)
