"""split_master / join_master and `coatstate convert --master-bits`: a float32 run and a bfloat16
run with master weights, converted into each other mid-training.

With master_bits=32 the conversion is exact both ways: a float32 run split into bfloat16 + master
after 5 steps, trained 5 more, and joined back equals the float32 run trained 10 steps, bit for
bit (weights, every moment tensor, the step counts)."""

from __future__ import annotations

import pytest
import torch
from coatstate.formats import master_weights as mw
from coatstate.formats.optimizer_state import MASTER_CORRECTION

import coatstate
from coatstate.cli.main import main as cli_main
from coatstate.optim import join_master, split_master

NAMES = ["embed.weight", "block.weight", "block.bias", "norm.weight"]
SHAPES = [(64, 96), (96, 64), (96,), (64,)]
KEEP = ["norm.weight"]


def _tensors(seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(torch.bfloat16).to(dtype) for s in SHAPES]


def _grads(step):
    return _tensors(100 + step)  # bfloat16-representable: both runs see the same values


def _optimizer(params, **kw):
    return coatstate.CompressedAdamW(
        [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}],
        lr=1e-2, min_numel=1, compress_1d=True, **kw,
    )  # fmt: skip


def _train(params, opt, steps):
    for i in steps:
        for p, g in zip(params, _grads(i), strict=True):
            p.grad = g.to(p.dtype)
        opt.step()


def _named(params) -> dict[str, torch.Tensor]:
    """The model state dict of `params` (detached), keyed by NAMES."""
    return dict(zip(NAMES, [p.detach() for p in params], strict=True))


def _same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for pid in a:
        assert a[pid].keys() == b[pid].keys(), pid
        for k in a[pid]:
            x, y = a[pid][k], b[pid][k]
            assert x.dtype == y.dtype and torch.equal(
                x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)
            ), (pid, k)


def test_32_bit_split_and_join_are_exact_mid_training():
    ref = [torch.nn.Parameter(t) for t in _tensors(0)]
    opt_ref = _optimizer(ref)
    _train(ref, opt_ref, range(5))
    model32 = dict(zip(NAMES, [p.detach().clone() for p in ref], strict=True))
    model16, osd16 = split_master(model32, opt_ref.state_dict(), master_bits=32, keep=KEEP, param_names=NAMES)
    assert [model16[n].dtype for n in NAMES] == [torch.bfloat16] * 3 + [torch.float32]

    half = [torch.nn.Parameter(model16[n].clone()) for n in NAMES]
    opt_half = _optimizer(half, master_bits=32)
    opt_half.load_state_dict(osd16)
    _train(ref, opt_ref, range(5, 10))
    _train(half, opt_half, range(5, 10))

    joined, osd32 = join_master(_named(half), opt_half.state_dict(), param_names=NAMES)
    for n, p in zip(NAMES, ref, strict=True):
        assert joined[n].dtype == torch.float32
        assert torch.equal(joined[n].view(torch.int32), p.detach().view(torch.int32)), n
    _same_state(osd32["state"], opt_ref.state_dict()["state"])
    assert all(g["master_bits"] is None for g in osd32["param_groups"])


def test_a_torch_adamw_state_splits_and_loads_compressed():
    ref = [torch.nn.Parameter(t) for t in _tensors(1)]
    adamw = torch.optim.AdamW(ref, lr=1e-2)
    _train(ref, adamw, range(3))
    model16, osd = split_master(
        _named(ref),
        adamw.state_dict(),
        master_bits=24,
        param_names=NAMES,
    )
    half = [torch.nn.Parameter(model16[n].clone()) for n in NAMES]
    opt = coatstate.CompressedAdamW(half, lr=1e-2, min_numel=1, master_bits=24)
    opt.load_state_dict(osd)
    for p, r in zip(half, ref, strict=True):
        master = mw.join24(p.detach(), opt.state[p][MASTER_CORRECTION])
        bound = mw.correction_scale(p.detach())  # formats.master_weights: within s of the master
        assert ((master - r.detach()).abs() <= bound).all()
    _train(half, opt, range(3, 5))  # and it trains on


def test_16_bit_split_rounds_to_nearest_and_keeps_no_correction():
    ref = [torch.nn.Parameter(t * 1.001) for t in _tensors(2)]
    opt = _optimizer(ref)
    _train(ref, opt, range(2))
    model16, osd = split_master(
        _named(ref),
        opt.state_dict(),
        master_bits=16,
        param_names=NAMES,
    )
    assert torch.equal(model16[NAMES[0]], mw.round_to_bf16(ref[0].detach()))
    assert not any(MASTER_CORRECTION in s for s in osd["state"].values())
    joined, _ = join_master(model16, osd, param_names=NAMES)
    assert torch.equal(joined[NAMES[0]], model16[NAMES[0]].float())


def test_conversion_refuses_what_it_cannot_map():
    ref = [torch.nn.Parameter(t) for t in _tensors(3)]
    opt = _optimizer(ref)
    model = _named(ref)
    with pytest.raises(ValueError, match="param_names"):
        split_master(model, opt.state_dict(), master_bits=32)
    with pytest.raises(ValueError, match="master_bits"):
        split_master(model, opt.state_dict(), master_bits=8, param_names=NAMES)
    with pytest.raises(ValueError, match="keep names"):
        split_master(model, opt.state_dict(), master_bits=32, keep=["nope"], param_names=NAMES)
    with pytest.raises(ValueError, match="has no"):
        split_master({}, opt.state_dict(), master_bits=32, param_names=NAMES)


def _run_cli(*argv):
    return cli_main(["convert", *map(str, argv)])


def test_convert_splits_and_joins_checkpoint_files(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.LayerNorm(96))
    opt = coatstate.CompressedAdamW(model.parameters(), lr=1e-2, min_numel=1)
    for i in range(3):
        torch.manual_seed(i)
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    src, split, back = (
        tmp_path / "fp32.safetensors",
        tmp_path / "m32.safetensors",
        tmp_path / "back.safetensors",
    )
    coatstate.save(opt, src, model=model)
    assert _run_cli(src, split, "--master-bits", "32", "--keep", r"^1\.") == 0  # the LayerNorm
    ckpt = coatstate.read(split)
    assert ckpt.model["0.weight"].dtype == torch.bfloat16 and ckpt.model["1.weight"].dtype == torch.float32
    assert MASTER_CORRECTION in ckpt.optimizer["state"][0]
    assert _run_cli(split, back, "--master-bits", "none") == 0
    restored, original = coatstate.read(back), coatstate.read(src)
    for k, v in original.model.items():
        assert torch.equal(restored.model[k], v), k
    _same_state(restored.optimizer["state"], original.optimizer["state"])
    pt = tmp_path / "adamw.pt"
    assert _run_cli(split, pt) == 0  # to torch AdamW: the moments decompressed, the master joined
    assert MASTER_CORRECTION not in torch.load(pt)["state"][0]


def test_convert_master_bits_needs_a_model(tmp_path):
    p = torch.nn.Parameter(torch.randn(64, 64))
    opt = coatstate.CompressedAdamW([p], min_numel=1)
    p.grad = torch.randn(64, 64)
    opt.step()
    coatstate.save(opt, tmp_path / "a.safetensors")
    assert _run_cli(tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--master-bits", "32") == 1
