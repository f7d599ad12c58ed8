"""Which kind of op saved a tensor, read off the call site that is running when autograd saves it.

The innermost Python frame's current instruction is a call (or an operator such as `@`) into
torch, and the name it calls (`F.linear`, `torch.layer_norm`, `x.softmax`, ...) gives the kind.
The answer depends only on (code object, instruction offset), so it is worked out once per call
site (from the bytecode's source positions) and then read from a dict: no TorchFunctionMode, no
cost per op that saves nothing. For calls that say nothing by themselves (the pow/mul/rsqrt of a
hand-written RMSNorm) the innermost nn.Module.forward on the Python stack gives the kind.
"""

from __future__ import annotations

import dis
import enum
import functools

import torch


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
