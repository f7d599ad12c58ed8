"""CompressedAdamW against torch.optim.AdamW: exactness, resume, switching, memory, errors."""

import io
import logging

import pytest
import torch

import coatstate
from coatstate import CompressedAdamW
from coatstate.optim import to_adamw_state_dict


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(48, 96), torch.nn.GELU(), torch.nn.LayerNorm(96), torch.nn.Linear(96, 40)
    )


def _groups(model, amsgrad=True):
    return [
        {"params": model[0].parameters(), "lr": 3e-3},
        {"params": model[2].parameters(), "weight_decay": 0.0},
        {"params": model[3].parameters(), "weight_decay": 0.3, "maximize": True, "amsgrad": amsgrad},
    ]


def _train(model, opt, steps, seed=1, scaler=None, inf_at=()):
    g = torch.Generator().manual_seed(seed)
    for i in range(steps):
        x = torch.randn(16, 48, generator=g)
        if i in inf_at:
            x[0, 0] = float("inf")
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_compression_off_equals_torch_adamw_bit_for_bit():
    ref, ours = _model(), _model()
    opt_ref = torch.optim.AdamW(_groups(ref), lr=1e-3, foreach=False)
    opt_ours = CompressedAdamW(_groups(ours), lr=1e-3, compress=False)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**16) for _ in range(2)]
    # steps 7 and 20 overflow: GradScaler skips them on both sides
    _train(ref, opt_ref, 50, scaler=scalers[0], inf_at=(7, 20))
    _train(ours, opt_ours, 50, scaler=scalers[1], inf_at=(7, 20))
    assert _same(ref, ours)
    assert opt_ours.state_dict()["state"][0]["step"].item() == 48


def test_compressed_tracks_adamw_closely():
    ref, ours = _model(), _model()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt_ours = CompressedAdamW(ours.parameters(), lr=1e-3, min_numel=1)
    _train(ref, opt_ref, 30)
    _train(ours, opt_ours, 30)
    rel = max(
        ((a - b).norm() / a.norm()).item() for a, b in zip(ref.parameters(), ours.parameters(), strict=True)
    )
    print(f"\n30 steps: largest relative parameter difference vs AdamW {rel:.2e}")
    assert rel < 1e-2


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(exp_avg_format="e5m2", exp_avg_sq_format="e5m2"),
        dict(exp_avg_expand=True, exp_avg_sq_expand=True),
    ],
    ids=["default", "e5m2", "expand"],
)
def test_resume_through_torch_save_is_bit_exact(options):
    straight, resumed = _model(), _model()
    opt_a = CompressedAdamW(_groups(straight), min_numel=1, **options)
    _train(straight, opt_a, 40)

    opt_b = CompressedAdamW(_groups(resumed), min_numel=1, **options)
    _train(resumed, opt_b, 20)
    buf = io.BytesIO()
    torch.save(opt_b.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    opt_c = CompressedAdamW(_groups(resumed), min_numel=1, **options)
    opt_c.load_state_dict(loaded)
    _train(resumed, opt_c, 20, seed=2)
    # the straight run saw seed 1 for all 40 steps; replay its second half with seed 2 instead
    straight2 = _model()
    opt_s = CompressedAdamW(_groups(straight2), min_numel=1, **options)
    _train(straight2, opt_s, 20)
    _train(straight2, opt_s, 20, seed=2)
    assert _same(straight2, resumed)


def test_switch_from_adamw_and_back():
    model = _model()
    adamw = torch.optim.AdamW(_groups(model, amsgrad=False), lr=1e-3)
    _train(model, adamw, 20)
    comp = CompressedAdamW(_groups(model, amsgrad=False), lr=1e-3, min_numel=1)
    comp.load_state_dict(adamw.state_dict())
    assert "exp_avg_codes" in comp.state_dict()["state"][0]
    for g_ours, g_ref in zip(comp.param_groups, adamw.param_groups, strict=True):
        assert g_ours["lr"] == g_ref["lr"] and g_ours["weight_decay"] == g_ref["weight_decay"]
    _train(model, comp, 20, seed=3)

    back = torch.optim.AdamW(_groups(model, amsgrad=False), lr=1e-3)
    back.load_state_dict(to_adamw_state_dict(comp.state_dict()))
    st = back.state_dict()["state"][0]
    assert st["exp_avg"].dtype == torch.float32 and st["step"].item() == 40
    before = [p.clone() for p in model.parameters()]
    _train(model, back, 5, seed=4)
    assert all(
        torch.isfinite(p).all() and not torch.equal(p, b)
        for p, b in zip(model.parameters(), before, strict=True)
    )


def test_state_bytes_per_parameter():
    params = [torch.nn.Parameter(torch.randn(256, 512)), torch.nn.Parameter(torch.randn(64, 1024))]
    opt = CompressedAdamW(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    per_param = opt.state_bytes() / sum(p.numel() for p in params)
    print(f"\nstate: {per_param:.4f} bytes/parameter")
    assert per_param <= 2.15


def test_uncompressed_parameters_are_reported(caplog):
    model = _model()
    opt = CompressedAdamW(model.parameters())
    kept = opt.uncompressed_parameters()
    assert {k["shape"] for k in kept} == {(96,), (40,), (40, 96)}  # 40*96 < 4096
    assert any("1-D" in k["reason"] for k in kept) and any("min_numel" in k["reason"] for k in kept)
    with caplog.at_level(logging.INFO, logger="coatstate"):
        _train(model, opt, 1)
    assert "keep float32 moments" in caplog.text


def test_global_shape_decides_precision():
    opt = CompressedAdamW([torch.nn.Parameter(torch.randn(64, 64))])
    assert opt.uncompressed_parameters() == []


def test_tensor_lr_and_none_grads_and_late_params():
    model = _model()
    opt = CompressedAdamW(model.parameters(), lr=torch.tensor(1e-3), min_numel=1)
    model[3].weight.requires_grad_(False)  # never gets a grad: no state, no error
    _train(model, opt, 3)
    assert model[3].weight not in opt.state
    model[3].weight.requires_grad_(True)  # appears late
    _train(model, opt, 2)
    assert opt.state[model[3].weight]["step"].item() == 2


def test_bf16_params_update_in_fp32():
    model = _model().to(torch.bfloat16)
    opt = CompressedAdamW(model.parameters(), lr=1e-2, min_numel=1)
    x = torch.randn(8, 48, dtype=torch.bfloat16)
    before = model[0].weight.clone()
    model(x).float().pow(2).mean().backward()
    opt.step()
    assert model[0].weight.dtype == torch.bfloat16 and not torch.equal(before, model[0].weight)


def test_bad_inputs_raise_clear_errors():
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="Invalid learning rate"):
        CompressedAdamW([p], lr=-1)
    with pytest.raises(ValueError, match="beta parameter at index 1"):
        CompressedAdamW([p], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="capturable"):
        CompressedAdamW([p], capturable=True)
    with pytest.raises(ValueError, match="exp_avg_format"):
        CompressedAdamW([p], exp_avg_format="int8")
    c = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
    c.grad = torch.randn_like(c)
    with pytest.raises(TypeError, match="complex"):
        CompressedAdamW([c]).step()
    s = torch.nn.Parameter(torch.randn(4, 4))
    s.grad = torch.randn(4, 4).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        CompressedAdamW([s]).step()
    with pytest.raises(ValueError, match="param groups"):
        CompressedAdamW([p]).load_state_dict({"state": {}, "param_groups": []})


@pytest.mark.parametrize(
    "kwargs, error, names",
    [
        ({"lr": "3e-4"}, TypeError, ["lr must be a number", "got str '3e-4'", "lr=0.0003"]),
        ({"weight_decay": "0.1"}, TypeError, ["weight_decay must be a number", "weight_decay=0.1"]),
        ({"betas": 0.9}, TypeError, ["betas must be a pair", "got float 0.9", "betas=(0.9, 0.999)"]),
        ({"betas": (0.9,)}, TypeError, ["betas must be a pair"]),
        ({"betas": (0.9, "0.99")}, TypeError, ["betas[1] must be a float", "got str"]),
    ],
)
def test_wrongly_typed_hyperparameters_name_the_argument_and_the_fix(kwargs, error, names):
    """Issue #49: lr="3e-4" (read from a config) and betas=0.9 raised torch's bare TypeErrors."""
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(error) as e:
        CompressedAdamW([p], **kwargs)
    assert all(n in str(e.value) for n in names), str(e.value)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_integer_parameters_are_refused_when_added(dtype):
    """Issue #49: an int64 parameter was accepted and stepped silently."""
    floats = torch.nn.Parameter(torch.randn(4, 4))
    ints = torch.nn.Parameter(torch.zeros(3, 5, dtype=dtype), requires_grad=False)
    refused = rf"parameter 1 is a {dtype} tensor of shape \(3, 5\).*is_floating_point"
    with pytest.raises(TypeError, match=refused):
        CompressedAdamW([floats, ints])
    opt = CompressedAdamW([floats])
    with pytest.raises(TypeError, match="param group 1: parameter 0"):
        opt.add_param_group({"params": [ints]})
    assert len(opt.param_groups) == 1  # refused: the optimizer stays as it was


def test_nonfinite_gradient_is_reported_on_cpu():
    model = _model()
    opt = CompressedAdamW(model.parameters(), min_numel=1)
    model(torch.randn(4, 48)).sum().backward()
    model[0].weight.grad[0, 0] = float("nan")
    opt.step()
    assert [b["shape"] for b in opt.nonfinite_parameters()] == [(96, 48)]


def test_public_namespace():
    assert coatstate.CompressedAdamW is CompressedAdamW


@pytest.mark.parametrize("master_bits", [None, 16])
def test_row_blocks_compute_what_the_whole_tensor_does(monkeypatch, master_bits):
    """The CPU step updates large parameters in blocks of whole rows (cache-sized); groups never
    cross a row and the math is per element or per group, so the blocks change no bit."""
    from coatstate.optim import reference_step

    results = []
    for block in (2**62, 64 * 40):  # whole tensor, then blocks of 64 rows
        monkeypatch.setattr(reference_step, "ROW_BLOCK_ELEMENTS", block)
        torch.manual_seed(0)
        dtype = torch.bfloat16 if master_bits else torch.float32
        p = torch.nn.Parameter(torch.randn(300, 40).to(dtype))
        opt = CompressedAdamW([p], lr=1e-2, fused=False, master_bits=master_bits, exp_avg_expand=True)
        for _ in range(3):
            p.grad = torch.randn(300, 40).to(dtype)
            opt.step()
        results.append((p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}))
    (p0, s0), (p1, s1) = results
    assert torch.equal(p0, p1)
    for key in s0:
        assert torch.equal(s0[key].reshape(-1).view(torch.uint8), s1[key].reshape(-1).view(torch.uint8)), key
