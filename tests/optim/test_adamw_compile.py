"""CompressedAdamW.step under torch.compile on CPU: the same bits as eager, without recompiling."""

from __future__ import annotations

import copy

import torch

from coatstate import CompressedAdamW


def test_compiled_step_on_cpu_matches_eager_without_a_recompile_storm():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    twin = copy.deepcopy(model)
    kw = dict(lr=1e-2, min_numel=0)  # the weights compressed, the biases float32: two shapes each
    opt, ref = CompressedAdamW(model.parameters(), **kw), CompressedAdamW(twin.parameters(), **kw)
    step = torch.compile(opt.step)
    gen = torch.Generator().manual_seed(1)
    # the pure-torch step once traced per parameter shape and step count, to the recompile limit
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        for _ in range(3):
            x = torch.randn(4, 32, generator=gen)
            model(x).square().mean().backward()
            twin(x).square().mean().backward()
            step()
            ref.step()
            opt.zero_grad()
            ref.zero_grad()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: the compiled step differs from the eager one"
        for key, value in opt.state[p].items():
            assert torch.equal(value, ref.state[q][key]), f"{name}: state {key} differs"
