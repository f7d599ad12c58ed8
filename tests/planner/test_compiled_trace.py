"""The planner's 'compiled' trace (coatstate/planner/compiled_trace.py): FP8 linear layers in blocks
compiled with CompiledActivations, traced on fake tensors, against the same trace on real CPU
tensors, and against what the partitioned graphs are known to hold."""

from __future__ import annotations

import dataclasses

import pytest
import torch  # noqa: E402

from coatstate.models import Llama, ModelConfig
from coatstate.nn import convert_to_fp8  # noqa: E402
from coatstate.planner.trace import trace  # noqa: E402

CFG = ModelConfig(vocab=512, dim=256, layers=4, heads=4, hidden=688, seq=256, loss_chunks=2)


def _build(k: int):
    return Llama(dataclasses.replace(CFG, layers=k))


def _trace(real: bool):
    def lowered(m):  # every width (the planner's default converter keeps layers under 1536)
        return convert_to_fp8(m, filter_fn=lambda mod, name: name != "head", min_features=None)

    return trace(
        _build,
        layers=CFG.layers,
        seq=CFG.seq,
        hidden=CFG.dim,
        vocab=CFG.vocab,
        autocast=False,
        dtype=torch.bfloat16,
        kinds=("fp8", "compiled"),
        fp8_convert=lowered,
        real=real,
    )


@pytest.mark.slow  # (the real trace runs two compiled steps of real FP8 GEMMs on the CPU)
def test_compiled_trace_fake_matches_real_cpu_tensors():
    fake, real = _trace(False), _trace(True)
    for b in (1, 4):
        for kind in ("compiled",):
            f, r = fake[kind], real[kind]
            assert f.saved(b, CFG.seq) == pytest.approx(r.saved(b, CFG.seq), rel=0.01)
            assert f.peak(b, CFG.seq) == pytest.approx(r.peak(b, CFG.seq), rel=0.02)


def test_compiled_blocks_hold_what_the_partitioner_saves():
    """Per layer and token: the block input, q, k, v and the attention output (bf16, kept by
    the policy; v is a compact copy, not a view pinning the whole qkv projection), the wo output
    and the gate/up projection per-group FP8 (1 + 1/16 bytes), and small statistics; far less
    than the eager FP8 path, whose linear layers each keep an FP8 copy of their input."""
    acts = _trace(False)
    d, h, seq = CFG.dim, CFG.hidden, CFG.seq
    per_token = acts["compiled"].live_layer(4, seq) / (4 * seq)
    expected = 2 * d * (1 + 2 + 1 + 1) + 1.0625 * (d + 2 * h)
    assert expected <= per_token <= expected * 1.02, (per_token, expected)
    assert acts["compiled"].saved(4, seq) < 0.8 * acts["fp8"].saved(4, seq)
