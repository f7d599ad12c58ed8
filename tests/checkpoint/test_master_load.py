"""coatstate.load of a bfloat16 checkpoint with master weights into a float32 model: each weight is
joined with its master correction (as join_master does), so the float32 parameters get the master
the run stepped on, not the bfloat16 weights alone."""

from __future__ import annotations

import pytest
import torch
from coatstate.formats.optimizer_state import MASTER_CORRECTION
from coatstate.formats.schema import CheckpointError

import coatstate
from coatstate.optim import join_master


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).to(dtype)


def _bf16_run(bits: int, url: str) -> tuple[dict, dict]:
    """A bfloat16 run with master_bits=`bits`, saved to `url`; (its model, optimizer) state dicts."""
    model = _model(torch.bfloat16)
    opt = coatstate.CompressedAdamW(model.parameters(), lr=1e-2, master_bits=bits, min_numel=1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        model(torch.randn(8, 32, generator=gen).bfloat16()).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    coatstate.save(opt, url, model=model)
    return model.state_dict(), opt.state_dict()


@pytest.mark.parametrize("bits", [32, 24])
def test_a_float32_load_joins_the_master_correction(bits, tmp_path):
    url = str(tmp_path / "bf16.safetensors")
    model_sd, opt_sd = _bf16_run(bits, url)
    names = [f"{i}.{w}" for i in (0, 2) for w in ("weight", "bias")]
    master, _ = join_master(model_sd, opt_sd, param_names=names)  # 32: exactly the float32 master
    model = _model(torch.float32)
    opt = coatstate.CompressedAdamW(model.parameters(), lr=1e-2, min_numel=1)
    coatstate.load(opt, url, model=model)
    got = model.state_dict()
    for name in names:
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], master[name]), name
    assert any(not torch.equal(got[n], model_sd[n].float()) for n in names)  # (the correction mattered)
    assert all(MASTER_CORRECTION not in s for s in opt.state.values())
    assert all(g["master_bits"] is None for g in opt.param_groups)
    model(torch.randn(4, 32)).square().mean().backward()
    opt.step()  # and the float32 run goes on from there


def test_a_bfloat16_load_keeps_weights_and_corrections(tmp_path):
    url = str(tmp_path / "bf16.safetensors")
    model_sd, opt_sd = _bf16_run(24, url)
    model = _model(torch.bfloat16)
    opt = coatstate.CompressedAdamW(model.parameters(), lr=1e-2, master_bits=24, min_numel=1)
    coatstate.load(opt, url, model=model)
    for name, t in model.state_dict().items():
        assert torch.equal(t, model_sd[name]), name
    for pid, p in enumerate(model.parameters()):
        assert torch.equal(opt.state[p][MASTER_CORRECTION], opt_sd["state"][pid][MASTER_CORRECTION])


def test_a_float32_load_without_the_model_names_the_fix(tmp_path):
    url = str(tmp_path / "bf16.safetensors")
    _bf16_run(32, url)
    model = _model(torch.float32)
    opt = coatstate.CompressedAdamW(model.parameters(), lr=1e-2, min_numel=1)
    with pytest.raises(CheckpointError, match="pass model=.*--master-bits none"):
        coatstate.load(opt, url)
    assert not opt.state  # nothing loaded
