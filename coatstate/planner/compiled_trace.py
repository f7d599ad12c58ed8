"""The planner's trace of CompiledActivations: blocks compiled the way inductor partitions them,
run without inductor's code generation.

Why not trace CompiledActivations through compress_activations: they hold different tensors. In a
compiled block inductor's min-cut partitioner decides what the forward saves, and
CompiledActivations rewrites that choice; the eager hooks see autograd's choice instead. For a
Llama block with FP8 linear layers the eager path holds each linear layer's FP8 input copy, the
norms' inputs and the SwiGLU product; the partitioner holds none of these (it recomputes them from
the block input, q/k/v, the attention output and the gate/up projection, which it packs); its v,
a view of the qkv projection's output, is held as a compact copy so as not to pin that buffer.

So each repeated block is compiled by dynamo and AOTAutograd as torch.compile(options=
CompiledActivations().options) would compile it: inductor's decompositions, its joint-graph
passes and the partitioner (`partition_fn` under `custom_partitioner_fn`), then the two graphs run
as plain fx code (no Triton or C++ generated: seconds, on fake tensors too). Every tensor the
graphs create goes through the dispatcher, so the planner's LiveBytes sees what they hold, views
and all. Run op by op, a graph would allocate every intermediate that inductor fuses away (a
transient several times the measured one: docs/planner.md), so while a graph runs LiveBytes
counts only what inductor materializes (`_Fused`).

FP8 linear layers are traced with torch._scaled_mm (the GPU's FP8 GEMM, which has a CPU kernel):
the emulation on CPU computes in float32 and changes what the partitioner saves.

Dynamo caches compiled code on the code object it was given: the blocks are called through a
function whose code object is made for this trace, so nothing is left in the caches of the
model's own code when the trace ends.
"""

from __future__ import annotations

import threading
import types

import torch
from torch import nn

from coatstate.activations.compiled import CompiledActivations


class _Fused(threading.local):
    """While a compiled graph runs (depth > 0), LiveBytes counts its buffers as inductor would
    allocate them: a pointwise op's output is fused into its consumer, and is a buffer only where
    an op inductor cannot fuse into (a matmul, attention: an extern kernel) reads it, or where the
    graph returns it (saved tensors, gradients). Reductions fuse their pointwise inputs too and
    write their own (small) outputs. Inductor also reuses freed buffers, which the weak references
    see as well."""

    def __init__(self) -> None:
        self.depth = 0
        self.trackers: list = []  # the LiveBytes modes entered, told of each graph's outputs


FUSED = _Fused()


def partitioner_backend(partitioner: CompiledActivations):
    """A torch.compile backend: AOTAutograd with inductor's decompositions, joint-graph passes and
    `partitioner`, whose forward and backward graphs run as fx code."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table

    def run_as_fx(gm: torch.fx.GraphModule, example_inputs):
        def run(*args):
            FUSED.depth += 1
            try:
                out = gm.forward(*args)
            finally:
                FUSED.depth -= 1
            for tracker in FUSED.trackers:
                tracker.materialize(out)
            return out

        return make_boxed_func(run)

    def partition(gm, joint_inputs, **kwargs):
        # inductor's config, not partition_fn's partitioner_fn_override, which torch 2.11 lacks
        with inductor_config.patch(custom_partitioner_fn=partitioner):
            return partition_fn(gm, joint_inputs, **kwargs)

    return aot_autograd(
        fw_compiler=run_as_fx,
        bw_compiler=run_as_fx,
        partition_fn=partition,
        decompositions=select_decomp_table(),
    )


def _own_caller():
    """call(module, *args, **kwargs) with a code object of its own (dynamo's cache lives on it)."""

    def call(module, *args, **kwargs):
        return module(*args, **kwargs)

    code = call.__code__.replace(co_name="coatstate_planner_block")
    return types.FunctionType(code, call.__globals__, code.co_name)


class CompiledBlock(nn.Module):
    """A block run through a compiled caller; its parameters stay the block's."""

    def __init__(self, block: nn.Module, caller) -> None:
        super().__init__()
        self.block = block
        self._caller = caller

    def forward(self, *args, **kwargs):
        return self._caller(self.block, *args, **kwargs)


def compile_blocks(blocks: nn.ModuleList, partitioner: CompiledActivations) -> None:
    """Each block of `blocks` replaced, in place, by a CompiledBlock sharing one compiled caller
    (static shapes, as the benchmarks compile: CompiledActivations keeps tensors of symbolic shape
    uncompressed)."""
    caller = torch.compile(_own_caller(), backend=partitioner_backend(partitioner), dynamic=False)
    for i, block in enumerate(blocks):
        blocks[i] = CompiledBlock(block, caller)


def use_fp8_gemm(model: nn.Module) -> None:
    """FP8Linear layers of `model` set to torch._scaled_mm, the GEMM they run on FP8 GPUs."""
    import dataclasses

    from coatstate.nn import FP8Linear

    for m in model.modules():
        if isinstance(m, FP8Linear):
            m.fp8_config = dataclasses.replace(m.fp8_config, backend="scaled_mm")


def check_partitioned(partitioner: CompiledActivations, runs: int) -> None:
    """Raise if the blocks ran without being compiled (dynamo falls back to eager on errors it
    only logs, and under a disabled dynamo): the trace would measure eager autograd instead."""
    if partitioner.graphs < runs:
        raise RuntimeError(
            f"the 'compiled' trace partitioned {partitioner.graphs} graph(s) for {runs} runs: the "
            "blocks did not compile (torch._dynamo disabled, or the model's block does not trace); "
            "plan the compress_activations variants instead"
        )
