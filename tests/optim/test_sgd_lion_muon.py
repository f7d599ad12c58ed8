"""CompressedSGD, CompressedLion and CompressedMuon against their references.

compress=False: bit for bit against torch.optim.SGD(foreach=False), torch.optim.Muon and the plain
float32 Lion below, on random non-zero gradients, odd shapes, several steps and several param
groups. Compressed: close to the reference (a bound per format), checks and errors as the
references', bytes per parameter.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import coatstate
from coatstate import CompressedAdamW, CompressedLion, CompressedMuon, CompressedSGD

SHAPES = [(3, 129), (7, 300), (5,), (1,), (2, 3, 4, 5), (130, 7)]
MATRICES = [(3, 129), (130, 7), (64, 64), (1, 5)]


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, Algorithm 2) in plain float32, as lion-pytorch writes it: the
    reference CompressedLion(compress=False) must equal bit for bit."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = -p.grad if group["maximize"] else p.grad
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.clone().mul_(beta1).add(g, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(g, alpha=1 - beta2)


def _params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _groups(params, extra):
    """Three param groups over `params`, the second and third overriding hyperparameters."""
    k = len(params)
    return [{"params": params[: k // 3]}, {"params": params[k // 3 : 2 * k // 3], **extra[0]},
            {"params": params[2 * k // 3 :], **extra[1]}]  # fmt: skip


def _run(opt, params, steps, seed=1, bf16_grads=False):
    """`steps` steps on random gradients (bfloat16 values with bf16_grads, in the params' dtype)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            grad = torch.randn(p.shape, generator=g) * torch.exp(torch.randn(p.shape, generator=g))
            p.grad = (grad.bfloat16() if bf16_grads else grad).to(p.dtype)
        opt.step()


def _assert_same(a, b):
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), (
            f"param {i} {tuple(x.shape)}: max difference {(x - y).abs().max().item():.3e}"
        )


CASES = {
    "sgd": (
        CompressedSGD,
        lambda groups, **kw: torch.optim.SGD(groups, foreach=False, **kw),
        SHAPES,
        dict(lr=0.05, momentum=0.9, weight_decay=0.01),
        [dict(nesterov=True, dampening=0.0, lr=0.02), dict(dampening=0.3, maximize=True, weight_decay=0.0)],
    ),
    "lion": (
        CompressedLion,
        Lion,
        SHAPES,
        dict(lr=1e-3, weight_decay=0.5),
        [dict(betas=(0.95, 0.98)), dict(maximize=True, weight_decay=0.0, lr=3e-3)],
    ),
    "muon": (
        CompressedMuon,
        torch.optim.Muon,
        MATRICES,
        dict(lr=0.02),
        [dict(nesterov=False, adjust_lr_fn="match_rms_adamw"), dict(momentum=0.8, weight_decay=0.0)],
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_compression_off_equals_the_reference_bit_for_bit(name):
    ours_cls, ref_cls, shapes, kw, extra = CASES[name]
    a, b = _params(shapes), _params(shapes)
    ref = ref_cls(_groups(a, extra), **kw)
    ours = ours_cls(_groups(b, extra), compress=False, **kw)
    _run(ref, a, 7)
    _run(ours, b, 7)
    _assert_same(a, b)
    moment = ours.MOMENTS[0]
    for p, q in zip(a, b, strict=True):
        assert torch.equal(ref.state[p][moment], ours.state[q][moment])


def test_sgd_tensor_lr_and_plain_sgd_equal_torch():
    for kw in (dict(lr=torch.tensor(0.05), momentum=0.9), dict(lr=0.1), dict(lr=0.1, weight_decay=0.1)):
        a, b = _params(SHAPES), _params(SHAPES)
        ref, ours = torch.optim.SGD(a, foreach=False, **kw), CompressedSGD(b, compress=False, **kw)
        _run(ref, a, 4)
        _run(ours, b, 4)
        _assert_same(a, b)
    assert "momentum_buffer" not in ours.state[b[0]]  # momentum 0: no buffer, as torch


FORMATS = {"e4m3": 0.08, "e5m2": 0.2, "e2m1": 0.5}
"""relative error of the compressed momentum after the run, per format (its quantization error
plus what it did to the trajectory)"""


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", CASES)
def test_compressed_momentum_tracks_the_reference(name, fmt):
    ours_cls, ref_cls, shapes, kw, extra = CASES[name]
    shapes = [(64, 256), (96, 130)]  # big enough to compress (min_numel=4096)
    a, b = _params(shapes), _params(shapes)
    ref = ref_cls(a, **kw)
    option = "exp_avg_format" if name == "lion" else "momentum_format"
    ours = ours_cls(b, **{option: fmt}, **kw)
    _run(ref, a, 5)
    _run(ours, b, 5)
    moment = ours.MOMENTS[0]
    assert ours.uncompressed_parameters() == []
    for p, q in zip(a, b, strict=True):
        state = ours.state[q]
        assert moment + "_codes" in state
        got = coatstate.formats.optimizer_state.read_moment(
            state, moment, 128, ours._formats(ours.param_groups[0], q)[moment], tuple(q.shape)
        )
        want = ref.state[p][moment]
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < FORMATS[fmt], f"{fmt}: relative error {rel:.3f}"


@pytest.mark.parametrize(
    ("fmt", "bound"), [("e4m3", 1.1), ("e5m2", 1.1), ("e2m1", 0.6)], ids=["e4m3", "e5m2", "e2m1"]
)
@pytest.mark.parametrize("name", CASES)
def test_state_bytes_per_parameter(name, fmt, bound):
    ours_cls, _, _, kw, _ = CASES[name]
    params = _params([(512, 1024), (1024, 512)])
    option = "exp_avg_format" if name == "lion" else "momentum_format"
    opt = ours_cls(params, **{option: fmt}, **kw)
    _run(opt, params, 1)
    per_param = opt.state_bytes() / sum(p.numel() for p in params)
    assert per_param <= bound, f"{per_param:.3f} bytes/param"
    fp32 = ours_cls(_params([(512, 1024)]), compress=False, **kw)
    _run(fp32, fp32.param_groups[0]["params"], 1)
    assert fp32.state_bytes() / (512 * 1024) == 4.0


def test_the_references_checks_and_messages():
    p = [torch.nn.Parameter(torch.randn(8, 8))]
    for kw, msg in [
        (dict(lr=-1), "Invalid learning rate"),
        (dict(momentum=-0.1), "Invalid momentum value"),
        (dict(weight_decay=-1), "Invalid weight_decay value"),
        (dict(nesterov=True, momentum=0.9, dampening=0.1), "Nesterov momentum requires"),
    ]:
        for cls in (torch.optim.SGD, CompressedSGD):
            with pytest.raises(ValueError, match=msg):
                cls(p, **kw)
    for kw, msg in [
        (dict(lr=-1), "Learning rate should be >= 0"),
        (dict(momentum=-1), "momentum should be >= 0"),
        (dict(adjust_lr_fn="x"), "Adjust learning rate function x is not supported"),
    ]:
        for cls in (torch.optim.Muon, CompressedMuon):
            with pytest.raises(ValueError, match=msg):
                cls(p, **kw)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        CompressedLion(p, betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="momentum_format"):
        CompressedSGD(p, momentum_format="ue3m1_sqrt", momentum=0.9)


def test_muon_refuses_what_torch_refuses():
    bias = torch.nn.Parameter(torch.randn(8))
    for cls in (torch.optim.Muon, CompressedMuon):
        with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
            cls([torch.nn.Parameter(torch.randn(4, 4)), bias])
    opt = CompressedMuon([torch.nn.Parameter(torch.randn(4, 4))])
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        opt.add_param_group({"params": [bias]})
    assert len(opt.param_groups) == 1


def test_param_group_options_are_checked_when_added():
    opt = CompressedSGD([torch.nn.Parameter(torch.randn(4, 4))], momentum=0.9)
    with pytest.raises(ValueError, match="param group 1: momentum"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4))], "momentum": -1})
    with pytest.raises(ValueError, match="param group 1: exp_avg_format"):
        CompressedLion([torch.nn.Parameter(torch.randn(4))]).add_param_group(
            {"params": [torch.nn.Parameter(torch.randn(4))], "exp_avg_format": "ue3m1_sqrt"}
        )


@pytest.mark.parametrize("name", CASES)
def test_reference_state_dict_loads_and_resumes_bit_for_bit(name):
    """A running reference job switches to the compressed optimizer (compress=False: exact)."""
    ours_cls, ref_cls, shapes, kw, extra = CASES[name]
    a, b = _params(shapes), _params(shapes)
    ref = ref_cls(_groups(a, extra), **kw)
    _run(ref, a, 3)
    for p, q in zip(a, b, strict=True):
        q.data.copy_(p.data)
    ours = ours_cls(_groups(b, extra), compress=False, **kw)
    ours.load_state_dict(ref.state_dict())
    _run(ref, a, 3, seed=5)
    _run(ours, b, 3, seed=5)
    _assert_same(a, b)


@pytest.mark.parametrize("name", CASES)
def test_state_dict_round_trip_through_torch_save(name, tmp_path):
    import io

    ours_cls, _, shapes, kw, extra = CASES[name]
    a, b = _params([(64, 256), (96, 130)]), _params([(64, 256), (96, 130)])
    opt = ours_cls(a, **kw)
    _run(opt, a, 2)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    for p, q in zip(a, b, strict=True):
        q.data.copy_(p.data)
    again = ours_cls(b, **kw)
    again.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    _run(opt, a, 2, seed=3)
    _run(again, b, 2, seed=3)
    _assert_same(a, b)


def test_another_optimizers_state_is_refused():
    p = [torch.nn.Parameter(torch.randn(64, 128))]
    adamw = CompressedAdamW(p)
    _run(adamw, p, 1)
    with pytest.raises(ValueError, match="lacks|exp_avg_sq"):
        CompressedSGD(p, momentum=0.9).load_state_dict(adamw.state_dict())
    sgd = torch.optim.SGD(p, momentum=0.9)
    _run(sgd, p, 1)
    with pytest.raises(ValueError, match="momentum_buffer"):
        CompressedLion(p).load_state_dict(sgd.state_dict())


@pytest.mark.parametrize("master_bits", [32, 24])
def test_bf16_params_with_master_weights_step_as_float32(master_bits):
    """master_bits=32: a bfloat16 weight plus its remainder is the float32 master bit for bit."""
    a = _params([(64, 130)])
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    ref = CompressedSGD(a, lr=0.05, momentum=0.9)
    with torch.no_grad():
        bf = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in b]
    ours = CompressedSGD(bf, lr=0.05, momentum=0.9, master_bits=master_bits)
    a[0].data.copy_(bf[0].data.float())
    _run(ref, a, 3, bf16_grads=True)
    _run(ours, bf, 3, bf16_grads=True)
    from coatstate.formats import master_weights

    join = master_weights.join32 if master_bits == 32 else master_weights.join24
    master = join(bf[0].detach(), ours.state[bf[0]]["master_correction"])
    diff = (master - a[0].detach()).abs().max().item()
    assert (diff == 0) if master_bits == 32 else diff <= 2**-14 * a[0].abs().max().item()


def test_gradient_release_equals_the_ordinary_step():
    model_a, model_b = (
        torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 8)) for _ in range(2)
    )
    model_b.load_state_dict(model_a.state_dict())
    opt_a = CompressedLion(model_a.parameters(), lr=1e-3, min_numel=1)
    with warnings.catch_warnings():  # (the note on clipping, shown once per process)
        warnings.simplefilter("ignore")
        opt_b = CompressedLion(model_b.parameters(), lr=1e-3, min_numel=1, gradient_release=True)
    for i in range(3):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(i))
        for model, opt in ((model_a, opt_a), (model_b, opt_b)):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    _assert_same(list(model_a.parameters()), list(model_b.parameters()))


def test_grad_scaler_skips_and_unscales_as_torch():
    a, b = _params(SHAPES), _params(SHAPES)
    ref = torch.optim.SGD(a, lr=0.05, momentum=0.9, foreach=False)
    ours = CompressedSGD(b, lr=0.05, momentum=0.9, compress=False)
    for opt, params in ((ref, a), (ours, b)):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        g = torch.Generator().manual_seed(0)
        for i in range(4):
            loss = sum((p * torch.randn(p.shape, generator=g)).sum() for p in params)
            if i == 2:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    _assert_same(a, b)


def test_public_namespace_and_docstrings():
    for cls in (CompressedSGD, CompressedLion, CompressedMuon):
        assert getattr(coatstate, cls.__name__) is cls and cls.__name__ in coatstate.__all__
        for section in ("Args:", "Returns:", "Raises:", "Example:"):
            assert section in cls.__doc__, f"{cls.__name__} lacks {section}"
