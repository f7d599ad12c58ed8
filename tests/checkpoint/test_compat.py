"""Checkpoints written by earlier releases keep loading, bit for bit, with the same state keys.

tests/data/checkpoint_v0_1.safetensors was written by coatstate 0.1.0 before the package was split
into subpackages (commit 9a3a905), with `python tests/checkpoint/test_compat.py --write`;
tests/data/checkpoint_v0_1_expected.safetensors holds that optimizer's state_dict() tensors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import coatstate

DATA = Path(__file__).resolve().parents[1] / "data"
CHECKPOINT = DATA / "checkpoint_v0_1.safetensors"
EXPECTED = DATA / "checkpoint_v0_1_expected.safetensors"


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 160), torch.nn.GELU(), torch.nn.Linear(160, 72))
    opt = coatstate.CompressedAdamW(
        [
            {"params": [model[0].weight, model[0].bias], "weight_decay": 0.1},
            {"params": [model[2].weight, model[2].bias], "lr": 3e-4, "amsgrad": True},
        ],
        lr=1e-3,
        min_numel=1024,
        compress_1d=True,
    )
    return model, opt


def _flat_state(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    sd = opt.state_dict()
    return {f"{pid}.{key}": t.contiguous() for pid, s in sd["state"].items() for key, t in s.items()}


def _write() -> None:
    model, opt = _model_and_optimizer()
    for _ in range(3):
        model(torch.randn(8, 96)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    DATA.mkdir(exist_ok=True)
    coatstate.save(opt, str(CHECKPOINT), model=model)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]]
    save_file(_flat_state(opt), str(EXPECTED), metadata={"param_groups": json.dumps(groups)})


def test_a_checkpoint_of_0_1_loads_bit_for_bit():
    model, opt = _model_and_optimizer()
    coatstate.load(opt, str(CHECKPOINT), model=model)
    expected = load_file(str(EXPECTED))
    got = _flat_state(opt)
    assert sorted(got) == sorted(expected), f"state keys changed: {sorted(set(got) ^ set(expected))}"
    for key, want in expected.items():
        assert got[key].dtype == want.dtype, key
        assert torch.equal(got[key].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), (
            f"{key} differs"
        )


def test_the_loaded_optimizer_keeps_training():
    model, opt = _model_and_optimizer()
    coatstate.load(opt, str(CHECKPOINT), model=model)
    model(torch.randn(8, 96)).square().mean().backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


if __name__ == "__main__" and "--write" in sys.argv:
    _write()
