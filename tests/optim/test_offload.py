"""HostOffloadAdamW: CompressedAdamW's states in host memory, stepped during backward.

On CPU the "device" parameters are CPU tensors and the copies synchronous, but the hooks, the
worker thread and its ordering are the ones a GPU runs. The contract checked here: parameters and
states equal a plain CompressedAdamW on CPU given the same gradients, bit for bit (fp32 and bf16
with master_bits=24, odd shapes, a scheduler, clipping as gradient release clips), checkpoints
move between the two unchanged, and what cannot be exact is refused with a message naming the fix.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import coatstate
from coatstate import CompressedAdamW, HostOffloadAdamW
from tests.conftest import requires_cuda


class _Net(torch.nn.Module):
    """Odd shapes: rows not a multiple of the group size, a 1-D bias, a tied weight."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.a = torch.nn.Linear(129, 301)
        self.b = torch.nn.Linear(301, 77, bias=False)
        self.norm = torch.nn.LayerNorm(77)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.a(x))
        return self.norm(self.b(h)) + h[:, :77] @ self.b.weight[:, :77]  # b.weight used twice


def _pair(dtype, seed=0, **kwargs):
    torch.manual_seed(seed)
    plain_model = _Net(dtype)
    off_model = _Net(dtype)
    off_model.load_state_dict(plain_model.state_dict())
    options = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, min_numel=64, **kwargs)
    if dtype == torch.bfloat16:
        options.setdefault("master_bits", 24)
    return plain_model, off_model, options


def _same_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for pid in a["state"]:
        sa, sb = a["state"][pid], b["state"][pid]
        assert sa.keys() == sb.keys(), pid
        for key in sa:
            va, vb = sa[key], sb[key]
            same = torch.equal(va.view(torch.uint8), vb.view(torch.uint8)) if va.dim() else va == vb
            assert same and va.dtype == vb.dtype, f"param {pid} {key} differs"


def _same_params(m1, m2) -> None:
    for (name, p), q in zip(m1.named_parameters(), m2.parameters(), strict=True):
        diff = (p - q).abs().max()
        assert torch.equal(p.view(torch.uint8), q.view(torch.uint8)), f"{name}: max diff {diff}"


def _train(model, opt, steps, seed, dtype, sched=None):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(6, 129, generator=gen).to(dtype)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_bits_equal_the_plain_cpu_path_with_a_scheduler(dtype, tensor_lr):
    plain_model, off_model, options = _pair(dtype)
    if tensor_lr:
        options["lr"] = torch.tensor(1e-2)
    plain = CompressedAdamW(plain_model.parameters(), **options)
    options = {**options, "lr": torch.tensor(1e-2)} if tensor_lr else options  # its own tensor
    offload = HostOffloadAdamW(off_model.parameters(), **options)
    sched_plain = torch.optim.lr_scheduler.StepLR(plain, step_size=2, gamma=0.5)
    sched_off = torch.optim.lr_scheduler.StepLR(offload, step_size=2, gamma=0.5)
    _train(plain_model, plain, 5, 1, dtype, sched_plain)
    _train(off_model, offload, 5, 1, dtype, sched_off)
    _same_params(plain_model, off_model)
    _same_state(plain.state_dict(), offload.state_dict())
    assert offload.state_bytes() == plain.state_bytes()
    assert all(t.device.type == "cpu" for s in offload.state.values() for t in s.values())


def test_gradients_set_by_hand_and_param_groups():
    plain_model, off_model, options = _pair(torch.bfloat16)
    groups = lambda m: [  # noqa: E731
        {"params": [m.a.weight, m.b.weight], "weight_decay": 0.2},
        {"params": [m.a.bias, *m.norm.parameters()], "lr": 3e-3, "master_bits": None},
    ]
    plain = CompressedAdamW(groups(plain_model), **options)
    offload = HostOffloadAdamW(groups(off_model), **options)
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        for p, q in zip(plain_model.parameters(), off_model.parameters(), strict=True):
            g = torch.randn(p.shape, generator=gen).to(p.dtype)
            if not (step == 1 and p.dim() == 1):  # a step where some parameters have no gradient
                p.grad, q.grad = g.clone(), g.clone()
        plain.step()
        offload.step()
        plain.zero_grad()
        offload.zero_grad()
    _same_params(plain_model, off_model)
    _same_state(plain.state_dict(), offload.state_dict())


def test_clipping_equals_gradient_release():
    plain_model, off_model, options = _pair(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        release = CompressedAdamW(
            plain_model.parameters(), gradient_release=True, max_grad_norm=0.05, **options
        )
    offload = HostOffloadAdamW(off_model.parameters(), max_grad_norm=0.05, **options)
    _train(plain_model, release, 4, 2, torch.bfloat16)
    _train(off_model, offload, 4, 2, torch.bfloat16)
    _same_params(plain_model, off_model)
    _same_state(release.state_dict(), offload.state_dict())


def test_a_weight_written_outside_drops_its_correction_as_plain_does():
    plain_model, off_model, options = _pair(torch.bfloat16)
    plain = CompressedAdamW(plain_model.parameters(), **options)
    offload = HostOffloadAdamW(off_model.parameters(), **options)
    _train(plain_model, plain, 2, 4, torch.bfloat16)
    _train(off_model, offload, 2, 4, torch.bfloat16)
    new = {k: v * 0.5 for k, v in plain_model.state_dict().items()}
    plain_model.load_state_dict(new)
    off_model.load_state_dict(new)
    _train(plain_model, plain, 2, 5, torch.bfloat16)
    _train(off_model, offload, 2, 5, torch.bfloat16)
    _same_params(plain_model, off_model)
    _same_state(plain.state_dict(), offload.state_dict())


def test_checkpoints_move_between_offload_and_plain(tmp_path):
    plain_model, off_model, options = _pair(torch.bfloat16)
    offload = HostOffloadAdamW(off_model.parameters(), **options)
    _train(off_model, offload, 3, 6, torch.bfloat16)
    coatstate.save(offload, tmp_path / "off.safetensors", model=off_model)

    plain = CompressedAdamW(plain_model.parameters(), **options)
    coatstate.load(plain, tmp_path / "off.safetensors", model=plain_model)
    _same_state(offload.state_dict(), plain.state_dict())
    _same_params(plain_model, off_model)
    coatstate.save(plain, tmp_path / "plain.safetensors", model=plain_model)

    torch.manual_seed(9)
    back_model = _Net(torch.bfloat16)
    back = HostOffloadAdamW(back_model.parameters(), **options)
    coatstate.load(back, tmp_path / "plain.safetensors", model=back_model)
    _same_state(plain.state_dict(), back.state_dict())
    _same_params(plain_model, back_model)
    # and the resumed runs go on alike: host copies follow the loaded weights, corrections kept
    _train(plain_model, plain, 2, 7, torch.bfloat16)
    _train(back_model, back, 2, 7, torch.bfloat16)
    _same_params(plain_model, back_model)
    _same_state(plain.state_dict(), back.state_dict())


def test_state_dict_round_trip_without_files():
    plain_model, off_model, options = _pair(torch.float32)
    offload = HostOffloadAdamW(off_model.parameters(), **options)
    _train(off_model, offload, 2, 8, torch.float32)
    plain = CompressedAdamW(plain_model.parameters(), **options)
    plain.load_state_dict(offload.state_dict())
    offload.param_groups[0]["lr"] = 0.5  # overwritten by the load below
    offload.load_state_dict(plain.state_dict())
    assert offload.param_groups[0]["lr"] == plain.param_groups[0]["lr"]
    _same_state(plain.state_dict(), offload.state_dict())


def test_gradient_accumulation_is_refused_with_the_fix():
    _, model, options = _pair(torch.float32)
    _opt = HostOffloadAdamW(model.parameters(), **options)  # (alive: its hooks refuse the 2nd backward)
    x = torch.randn(2, 129)
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="gradient accumulation.*opt.step\\(\\) after every backward"):
        model(x).sum().backward()


def test_grad_scaler_is_refused():
    _, model, options = _pair(torch.float32)
    opt = HostOffloadAdamW(model.parameters(), **options)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 129)).sum()).backward()
    with pytest.raises(RuntimeError, match="GradScaler does not work with HostOffloadAdamW"):
        scaler.step(opt)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"fused": True}, "fused=True"),
        ({"gradient_release": True}, "gradient_release"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"lr": -1.0}, "learning rate"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HostOffloadAdamW(torch.nn.Linear(4, 4).parameters(), **kwargs)


def test_an_error_on_the_host_reaches_step():
    _, model, options = _pair(torch.float32)
    opt = HostOffloadAdamW(model.parameters(), **options)

    def broken(*args, **kwargs):
        raise ValueError("host step failed")

    opt._inner.step = broken
    model(torch.randn(2, 129)).sum().backward()
    with pytest.raises(ValueError, match="host step failed"):
        opt.step()


def test_gradients_leave_the_model_during_backward_and_timings_are_reported():
    _, model, options = _pair(torch.float32)
    opt = HostOffloadAdamW(model.parameters(), **options)
    model(torch.randn(2, 129)).sum().backward()
    assert all(p.grad is None for p in model.parameters())  # freed as they were shipped
    opt.step()
    t = opt.timings()
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    assert t.d2h_bytes == n and t.h2d_bytes == n and t.host_step_s > 0
    assert opt.host_bytes()["grad_buffers"] == n


@pytest.mark.gpu
@requires_cuda
def test_cuda_gradients_leave_the_gpu_during_backward():
    """After backward only the weights stay allocated: every gradient went to the host."""
    torch.manual_seed(0)
    model = _Net(torch.bfloat16).cuda()
    opt = HostOffloadAdamW(model.parameters(), min_numel=64)
    x = torch.randn(4, 129, device="cuda").bfloat16()
    loss = model(x).float().square().mean()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    del loss
    assert all(p.grad is None for p in model.parameters())
    assert torch.cuda.memory_allocated() <= before
    assert all(b.is_pinned() for b in opt._grad_buffers.values()) and opt.timings().d2h_s > 0


@pytest.mark.gpu
@requires_cuda
def test_cuda_bits_equal_the_cpu_path():
    """On a GPU: gradients computed on the device, the host step bit-equal to a plain CompressedAdamW
    on CPU given the same (device-computed) gradients."""
    torch.manual_seed(0)
    gpu_model = _Net(torch.bfloat16).cuda()
    cpu_model = _Net(torch.bfloat16)
    cpu_model.load_state_dict({k: v.cpu() for k, v in gpu_model.state_dict().items()})
    options = dict(lr=1e-2, min_numel=64, master_bits=24)
    offload = HostOffloadAdamW(gpu_model.parameters(), **options)
    plain = CompressedAdamW(cpu_model.parameters(), **options)
    grads = {}
    hooks = [
        p.register_hook(lambda g, n=n: grads.__setitem__(n, g.cpu())) for n, p in gpu_model.named_parameters()
    ]
    for _ in range(3):
        gpu_model(torch.randn(4, 129, device="cuda").bfloat16()).float().square().mean().backward()
        offload.step()
        for n, p in cpu_model.named_parameters():
            p.grad = grads[n]
        plain.step()
        plain.zero_grad()
    for h in hooks:
        h.remove()
    _same_params(cpu_model, gpu_model.cpu())


def test_host_arena_packs_tensors_with_their_own_version_counters():
    from coatstate.optim.offload_pipeline import HostArena

    arena = HostArena(pin=False, chunk_bytes=4096)
    a = arena.empty_like(torch.empty(3, 5, dtype=torch.bfloat16))
    b = arena.empty_like(torch.empty(7, dtype=torch.float32))
    big = arena.empty_like(torch.empty(2000, dtype=torch.float32))  # over a quarter chunk: its own
    storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    assert storage(a) == storage(b) != storage(big)
    assert b.data_ptr() - a.data_ptr() == HostArena.ALIGN and arena.reserved == 4096 + 8000
    version = a._version
    b.fill_(1.0)
    assert a._version == version  # a write to a neighbour is not a write to `a`


def test_offload_benchmark_setup_runs_in_process():
    """benchmarks/offload.py's per-setup function on the smoke model: host bytes, rounds, finite."""
    from offload import MODELS, run_setup

    written = []
    r = run_setup("coatstate", MODELS["smoke"], "cpu", 24.0, 1, 2, 1, 60.0, written.append)
    assert r["status"] == "ok" and r["finite"] and len(r["steps"]) == 2 and len(written) == 3
    assert 0 < r["host_bytes"]["states"] < r["host_bytes"]["buffers"]  # FP8 moments < weights + grads
    assert r["rounds"]["tokens_per_s"]["min"] <= r["rounds"]["tokens_per_s"]["max"]


def test_planner_offload_row_holds_what_host_offload_adamw_holds():
    """The planner's offload row: host states byte for byte what HostOffloadAdamW holds after a
    step, buffers a weight copy and a gradient per parameter, and the bytes a step moves."""
    from coatstate.planner import Variant, plan, resolve_model
    from coatstate.planner.offload import offload_row

    spec = resolve_model(None, arch="llama", layers=2, hidden=256, heads=4, ffn=512, vocab=1000, max_seq=64)
    torch.manual_seed(0)
    model = spec.build(2).to(torch.bfloat16)
    opt = HostOffloadAdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    the_plan = plan(spec, seq=64, variants=[Variant("c", "compressed", "none")], progress=False)
    row = offload_row(the_plan)
    held = opt.host_bytes()
    assert row.host["optimizer"] + row.host["master"] == held["states"]
    assert row.host["buffers"] == held["weights"] + held["grad_buffers"] == 4 * the_plan.params
    assert row.pcie_bytes == 4 * the_plan.params and row.gpu["grads"] < 2 * the_plan.params
    assert row.bandwidth(2.0)["pcie_gb_s"] == row.pcie_bytes / 1e9 / 2.0
    assert "offload (HostOffloadAdamW" in the_plan.table() and the_plan.to_dict()["offload"]["pcie_bytes"]
