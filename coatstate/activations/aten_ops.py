"""The aten ops CompiledActivations recognises in a partitioned graph, by role."""

from __future__ import annotations

import torch
import torch.fx as fx

_aten = torch.ops.aten


def _ops(names: str) -> frozenset:
    """aten overloads by 'name.overload', skipping those this torch version lacks."""
    found = []
    for name in names.split():
        packet, overload = name.split(".")
        op = getattr(getattr(_aten, packet, None), overload, None)
        if op is not None:
            found.append(op)
    return frozenset(found)


VIEWS = _ops(
    "view.default _unsafe_view.default reshape.default permute.default transpose.int t.default "
    "expand.default slice.Tensor select.int unsqueeze.default squeeze.dim squeeze.dims alias.default"
) | {torch.ops.prims.convert_element_type.default}
MATMULS = _ops(
    "mm.default addmm.default bmm.default baddbmm.default _scaled_mm.default convolution.default "
    "_int_mm.default"
)
ATTENTION = _ops(
    "_scaled_dot_product_flash_attention.default _scaled_dot_product_efficient_attention.default "
    "_scaled_dot_product_cudnn_attention.default _scaled_dot_product_flash_attention_for_cpu.default "
    "_flash_attention_forward.default _efficient_attention_forward.default"
)
SPLITS = _ops("split.Tensor split_with_sizes.default unbind.int chunk.default")
REDUCTIONS = _ops(
    "var_mean.correction mean.dim var.correction sum.dim_IntList amax.default amin.default "
    "logsumexp.default max.dim min.dim"
)
NORM_REDUCTIONS = _ops("var_mean.correction mean.dim var.correction native_layer_norm.default")
ACTIVATIONS = _ops("erf.default tanh.default sigmoid.default gelu.default silu.default relu.default")
LOSSES = _ops("gather.default nll_loss_forward.default nll_loss2d_forward.default")
# one step between a norm's input and its reduction: x*x, x - mean, residual + x
POINTWISE_TO_REDUCTION = _ops("pow.Tensor_Scalar mul.Tensor sub.Tensor add.Tensor")
STATISTIC_STEPS = _ops(
    "add.Tensor add.Scalar sub.Tensor rsqrt.default sqrt.default reciprocal.default div.Tensor"
)


def is_pointwise(node: fx.Node) -> bool:
    target = node.target
    if target in VIEWS:
        return True
    tags = getattr(target, "tags", ())  # (a split's pieces are not followed: splits have no tag)
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags


def is_view(node: fx.Node) -> bool:
    """A view of its input: in VIEWS but not a dtype cast (which computes a new tensor)."""
    return node.target in VIEWS and node.target is not torch.ops.prims.convert_element_type.default
