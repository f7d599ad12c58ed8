"""CompressedAdamW under FSDP2 (DTensor states), DDP and torch.distributed.checkpoint, on CPU/gloo.

Each test starts its ranks from a fork server that has imported torch and coatstate once (a
file store, one intra-op thread per rank); rank 0 also trains the single-process
reference on the same data. World sizes 1, 2 and 4 (4 ranks on CI's 2 cores takes ~3 s).

Exactness. Every rank sees the same batch, so FSDP2's reduce-scatter averages equal gradients,
(g + g) / 2 = g exactly, and the sharded step starts from the reference's bits. The step itself
works row by row, so a shard computes what the full tensor computes, with one CPU caveat: torch
runs log2/exp2 vectorized (Sleef) on most of a tensor but with scalar libm on its last few
elements (fewer than 2 vector widths, i.e. < 32 floats with AVX-512), and the two can differ by
1 ulp. A scale of a row that is in the scalar tail of its shard but not of the full tensor (or
vice versa) can then differ by 1 ulp. So parameters whose shards hold a multiple of 64 scales
(0.weight, 4.weight at world sizes 1, 2, 4) and the float32-moment ones (biases, LayerNorm) are
checked bit for bit; the uneven one (131 rows: 66 + 65 over 2 ranks) within FP8 rounding (bounds
in `_check_close`). The fused Triton step has no such tail (every group runs the same code), so
it is checked bit for bit on uneven shards. Loading a checkpoint at another world size moves
bits only, so states after a reshard are compared bit for bit for every parameter.
"""

from __future__ import annotations

import atexit
import math
import multiprocessing
import os
import shutil
import sys
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp
from coatstate.formats.group import dequantize_groups, group_layout

import coatstate
from coatstate import CompressedAdamW
from coatstate.cli import main as cli_main
from tests.conftest import requires_cuda

LR = 1e-2
STEPS = 10
MORE = 3
SPAWN_TIMEOUT_S = 300
"""A test's ranks fail after this long instead of hanging CI (each finishes in seconds)."""
UNEVEN = "2.weight"  # 131 x 256: rows 66 + 65, two groups per row (0.weight: 256 x 64, 4.weight: 128 x 131)


def _rendezvous() -> str:
    """A file store in a fresh directory: unlike a free TCP port picked and released here, nothing
    another test (or pytest-xdist worker) does can take it before rank 0 binds it."""
    directory = tempfile.mkdtemp(prefix="coatstate-dist-")
    atexit.register(shutil.rmtree, directory, True)
    return f"file://{directory}/store"


def _spawn(fn, world_size: int, *args, start_method: str = "forkserver") -> None:
    # a fork server that has imported torch and coatstate once starts each rank in ~0.1 s (a
    # spawned rank takes ~5-10 s to import them on a 2-core CI machine); it has never run an
    # OpenMP region, so forking it is safe. CUDA ranks spawn: importing the Triton kernels may
    # initialize CUDA in the server, and a forked child cannot use it then.
    if start_method == "forkserver":
        preload = ["torch", "coatstate", "coatstate.kernels.adamw_fused", __name__]
        multiprocessing.set_forkserver_preload(preload)
    ranks = mp.start_processes(
        fn, args=(world_size, _rendezvous(), *args), nprocs=world_size, join=False, start_method=start_method
    )
    _join_ranks(ranks, fn.__name__)


def _join_ranks(ranks, what: str) -> None:
    """Wait for started ranks (a rank's error is raised); kill them and fail after SPAWN_TIMEOUT_S."""
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ranks.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in ranks.processes:
                process.kill()
            raise AssertionError(f"{what}: ranks still running after {SPAWN_TIMEOUT_S} s (a hang)")


def _init(rank: int, world_size: int, store: str, device_type: str = "cpu"):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    backend = "gloo" if device_type == "cpu" else "nccl"
    dist.init_process_group(backend, init_method=store, rank=rank, world_size=world_size)
    return init_device_mesh(device_type, (world_size,))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),  # compressed, aligned
        torch.nn.GELU(),
        torch.nn.Linear(256, 131),  # compressed, uneven rows
        torch.nn.LayerNorm(131),  # 1-D: float32 moments, sharded 66 + 65
        torch.nn.Linear(131, 128),  # compressed, aligned, a short last group per row
    )


def _fsdp(mesh, device: torch.device | None = None) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _model().to(device or "cpu")
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _optimizer(model: torch.nn.Module) -> CompressedAdamW:
    return CompressedAdamW(model.named_parameters(), lr=LR, weight_decay=0.1)


def _train(model, opt, first: int, steps: int, device: torch.device | None = None) -> None:
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(16, 64, generator=gen), torch.randn(16, 128, generator=gen)
        torch.nn.functional.mse_loss(model(x.to(device or "cpu")), y.to(device or "cpu")).backward()
        opt.step()
        opt.zero_grad()


def _snapshot(model, opt) -> dict[str, dict[str, torch.Tensor]]:
    """{param name: {"param": full tensor, state key: full tensor}} on every rank (a collective)."""
    from coatstate.distributed import full_tensor

    out = {}
    for name, p in model.named_parameters():
        entry = {"param": full_tensor(p).detach().clone()}
        for key, value in opt.state[p].items():
            entry[key] = full_tensor(value).detach().clone()
        out[name] = entry
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _check_equal(got, want, names, what: str) -> None:
    for name in names:
        for key, w in want[name].items():
            g = got[name][key]
            assert g.shape == w.shape and g.dtype == w.dtype, f"{what}: {name}.{key} {g.shape} vs {w.shape}"
            if not torch.equal(_bits(g), _bits(w)):
                diff = int((_bits(g) != _bits(w)).sum())
                raise AssertionError(f"{what}: {name}.{key} differs in {diff} of {w.numel()} elements")


def _moment(entry, name: str) -> torch.Tensor:
    codes = entry[f"{name}_codes"]
    rows, cols, _ = group_layout(codes.shape, 128)
    return dequantize_groups(
        codes.reshape(rows, cols), entry[f"{name}_scales"], entry.get(f"{name}_exponents"), 128
    )


def _check_close(got, want, name: str, steps: int) -> None:
    """Within FP8 rounding. A 1-ulp scale can move a code by one FP8 step (E4M3: 3 mantissa bits;
    with expansion k >= 1 a step is at most 2**-3 relative), so each dequantized moment element
    is within 2**-3 relative of the reference's. A parameter moves by lr * m/denom per step,
    and one rounding step in m and in v changes m/denom by at most ~2**-2 relative (|m/denom| <= 1
    for Adam), so the parameters are within steps * lr * 2**-2."""
    g, w = got[name], want[name]
    dp = (g["param"] - w["param"]).abs().max().item()
    assert dp <= steps * LR * 2**-2, f"{name}: params differ by {dp:.3g} > {steps * LR * 2**-2:.3g}"
    for m in ("exp_avg", "exp_avg_sq"):
        a, b = _moment(g, m), _moment(w, m)
        rel = ((a - b).abs() / b.abs().clamp(min=1e-30)).max().item()
        assert rel <= 2**-3, f"{name}.{m}: dequantized moments differ by {rel:.3g} relative > 2**-3"


# ------------------------------------------------------------------------------------ workers
def _fsdp_worker(rank, world_size, store, out_dir):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    mesh = _init(rank, world_size, store)
    model = _fsdp(mesh)
    opt = _optimizer(model)
    p = dict(model.named_parameters())[UNEVEN]
    assert type(opt.param_groups[0]["params"][0]).__name__ == "DTensor"
    _train(model, opt, 0, STEPS)
    state = opt.state[p]
    local = state["exp_avg_codes"].to_local().shape[0]
    assert local == (66, 65)[rank] and state["exp_avg_scales"].to_local().shape == (local, 2), "uneven shards"
    assert type(state["exp_avg_codes"]).__name__ == "DTensor" and state["exp_avg_codes"].shape == p.shape

    at_save = _snapshot(model, opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out_dir, "dcp_ws2"))
    coatstate.save(opt, os.path.join(out_dir, "gathered.safetensors"), model=model)
    _train(model, opt, STEPS, MORE)
    after = _snapshot(model, opt)
    if rank == 0:
        ref = _model()
        ref_opt = _optimizer(ref)
        _train(ref, ref_opt, 0, STEPS)
        want = {n: {"param": q.detach().clone(), **ref_opt.state[q]} for n, q in ref.named_parameters()}
        _check_equal(at_save, want, [n for n in want if n != UNEVEN], "FSDP2 vs one process")
        _check_close(at_save, want, UNEVEN, STEPS)
        torch.save({"at_save": at_save, "after": after}, os.path.join(out_dir, "ws2.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _resume_worker(rank, world_size, store, out_dir, source, save_as):
    """Load `source` (a DCP dir) at this world size, check the states, save `save_as`, continue."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = _init(rank, world_size, store)
    ref = torch.load(os.path.join(out_dir, "ws2.pt"), weights_only=True)
    model = _fsdp(mesh)
    opt = _optimizer(model)
    msd, osd = get_state_dict(model, opt)  # initialises the states (a step with lr 0)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out_dir, source))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    _check_equal(
        _snapshot(model, opt), ref["at_save"], list(ref["at_save"]), f"after dcp.load at {world_size}"
    )
    if save_as:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out_dir, save_as))

    # coatstate.load of the gathered file: each rank keeps its rows
    model2 = _fsdp(mesh)
    opt2 = _optimizer(model2)
    coatstate.load(opt2, os.path.join(out_dir, "gathered.safetensors"), model=model2)
    _check_equal(_snapshot(model2, opt2), ref["at_save"], list(ref["at_save"]), "after coatstate.load")

    _train(model, opt, STEPS, MORE)
    after = _snapshot(model, opt)
    if rank == 0:
        _check_equal(after, ref["after"], [n for n in after if n != UNEVEN], f"continued at {world_size}")
        _check_close(after, ref["after"], UNEVEN, STEPS + MORE)
    dist.barrier()
    dist.destroy_process_group()


def _small(device) -> torch.nn.Module:
    torch.manual_seed(0)  # 67 rows: 34 + 33 per rank; Triton's interpreter takes ~50 ms a program
    return torch.nn.Sequential(torch.nn.Linear(32, 67), torch.nn.GELU(), torch.nn.Linear(67, 8)).to(device)


def _small_steps(model, device, steps: int = 2) -> CompressedAdamW:
    opt = CompressedAdamW(model.named_parameters(), lr=LR, weight_decay=0.1, fused=True, min_numel=1)
    for step in range(steps):  # the second step reads back quantized moments
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 32, generator=gen).to(device), torch.randn(8, 8, generator=gen).to(device)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return opt


def _fused_worker(rank, world_size, store, device_type):
    """The fused Triton step on each rank's local shards (CUDA, or Triton's interpreter on CPU,
    which conftest.py turns on without a GPU) equals it on the full tensors, bit for bit, for
    uneven shards too: the kernel treats every group alike, wherever it sits."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if device_type == "cuda":
        os.environ.update(
            NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1"
        )
        torch.cuda.set_device(rank)
    mesh = _init(rank, world_size, store, device_type)
    device = torch.device(device_type, rank if device_type == "cuda" else None)
    model = _small(device)
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    opt = _small_steps(model, device)
    got = _snapshot(model, opt)
    if rank == 0:
        ref = _small(device)
        ref_opt = _small_steps(ref, device)
        want = {n: {"param": q.detach(), **ref_opt.state[q]} for n, q in ref.named_parameters()}
        want = {n: {k: v.cpu() for k, v in e.items()} for n, e in want.items()}
        got = {n: {k: v.cpu() for k, v in e.items()} for n, e in got.items()}
        assert "exp_avg_codes" in want["0.weight"] and got["0.weight"]["exp_avg_codes"].shape == (67, 32)
        _check_equal(got, want, list(want), f"fused step, FSDP2 on {device_type} vs one process")
    dist.barrier()
    dist.destroy_process_group()


def _ddp_worker(rank, world_size, store, out_dir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    _init(rank, world_size, store)
    model = DistributedDataParallel(_model())
    opt = CompressedAdamW(model.parameters(), lr=LR, weight_decay=0.1)
    _train(model, opt, 0, STEPS)
    if rank == 0:
        ref = _model()
        ref_opt = CompressedAdamW(ref.parameters(), lr=LR, weight_decay=0.1)
        _train(ref, ref_opt, 0, STEPS)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q), "DDP parameters differ from the one-process run"
            for key, value in ref_opt.state[q].items():
                assert torch.equal(_bits(opt.state[p][key]), _bits(value)), f"DDP state {key} differs"
        coatstate.save(opt, os.path.join(out_dir, "ddp.safetensors"))
    dist.barrier()
    # DDP's reducer holds the process group; released after destroy_process_group, gloo's
    # destructor can hang joining its thread (a CI run hung there): release it while it lives
    del model, opt
    dist.destroy_process_group()


# -------------------------------------------------------------------------------------- tests
pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or sys.platform == "win32",
    reason="needs torch.distributed with gloo",
)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fsdp"))
    _spawn(_fsdp_worker, 2, out)
    return out


def test_fsdp2_matches_one_process(fsdp_run):
    assert os.path.exists(os.path.join(fsdp_run, "ws2.pt"))  # the checks ran on rank 0


def test_dcp_reshard_2_to_1_to_2(fsdp_run):
    _spawn(_resume_worker, 1, fsdp_run, "dcp_ws2", "dcp_ws1")
    _spawn(_resume_worker, 2, fsdp_run, "dcp_ws1", None)


def test_dcp_load_at_4(fsdp_run):
    """Four ranks on two cores: the 131-row parameter splits 33 + 33 + 33 + 32."""
    _spawn(_resume_worker, 4, fsdp_run, "dcp_ws2", None)


def test_gathered_file_and_dcp_convert_match(fsdp_run, tmp_path):
    """coatstate.save of the sharded optimizer == `coatstate convert` of its DCP directory."""
    gathered = coatstate.read(os.path.join(fsdp_run, "gathered.safetensors"))
    out = tmp_path / "from_dcp.safetensors"
    assert cli_main(["convert", os.path.join(fsdp_run, "dcp_ws2"), str(out)]) == 0
    converted = coatstate.read(out)
    names = {int(k): v["name"] for k, v in converted.header["params"].items()}
    assert names[0] == "0.weight" and gathered.header["params"]["2"]["name"] == "2.weight"
    for pid, state in gathered.optimizer["state"].items():
        for key, value in state.items():
            assert torch.equal(_bits(converted.optimizer["state"][pid][key]), _bits(value)), (pid, key)
    for key, value in gathered.model.items():
        assert torch.equal(converted.model[key], value), key
    ref = torch.load(os.path.join(fsdp_run, "ws2.pt"), weights_only=True)["at_save"]
    assert torch.equal(
        _bits(gathered.optimizer["state"][2]["exp_avg_codes"]), _bits(ref["2.weight"]["exp_avg_codes"])
    )


def test_dcp_directory_to_adamw_pt(fsdp_run, tmp_path):
    out = tmp_path / "adamw.pt"
    assert cli_main(["convert", os.path.join(fsdp_run, "dcp_ws2"), str(out)]) == 0
    sd = torch.load(out, weights_only=True)
    ref = torch.load(os.path.join(fsdp_run, "ws2.pt"), weights_only=True)["at_save"]["2.weight"]
    assert set(sd["state"][2]) == {"step", "exp_avg", "exp_avg_sq"}
    assert torch.equal(sd["state"][2]["exp_avg"], _moment(ref, "exp_avg").reshape(131, 256))


def test_torch_adamw_on_fsdp2_save_load(tmp_path):
    """coatstate.save/load of a plain torch.optim.AdamW over DTensors: gathered, then resharded."""
    _spawn(_torch_adamw_worker, 2, str(tmp_path))


def _torch_adamw_worker(rank, world_size, store, out_dir):
    import torch.distributed as dist

    mesh = _init(rank, world_size, store)
    runs = []
    for _ in range(2):
        model = _fsdp(mesh)
        runs.append((model, torch.optim.AdamW(model.parameters(), lr=LR)))
    _train(*runs[0], 0, 2)
    path = os.path.join(out_dir, "adamw.safetensors")
    coatstate.save(runs[0][1], path, model=runs[0][0])
    coatstate.load(runs[1][1], path, model=runs[1][0])
    # a failed write on rank 0 raises on every rank (none returns as if it had been saved)
    with pytest.raises(ValueError, match="nosuchprotocol" if rank == 0 else "rank 0 could not write"):
        coatstate.save(runs[0][1], "nosuchprotocol://x.safetensors")
    for model, opt in runs:
        _train(model, opt, 2, 1)
    a, b = (_snapshot(model, opt) for model, opt in runs)
    assert type(runs[1][1].state[next(runs[1][0].parameters())]["exp_avg"]).__name__ == "DTensor"
    _check_equal(b, a, list(a), "torch AdamW after coatstate.load")
    dist.destroy_process_group()


def test_dcp_directory_reader_refuses_foreign_pickles(fsdp_run, tmp_path):
    import pickle
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(os.path.join(fsdp_run, "dcp_ws2"), bad)
    (bad / ".metadata").write_bytes(pickle.dumps(os.system))
    with pytest.raises(coatstate.CheckpointError, match="os.system|posix.system|refusing"):
        coatstate.read(str(bad))


@pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1", reason="CPU: Triton's interpreter"
)
def test_fused_step_on_local_shards_interpreter():
    _spawn(_fused_worker, 2, "cpu")


@pytest.mark.gpu
@requires_cuda
def test_fused_step_on_local_shards_cuda():
    _spawn(_fused_worker, min(2, torch.cuda.device_count()), "cuda", start_method="spawn")


def test_ddp_matches_one_process(tmp_path):
    _spawn(_ddp_worker, 2, str(tmp_path))
    ckpt = coatstate.read(tmp_path / "ddp.safetensors")
    assert any(k.endswith("_codes") for s in ckpt.optimizer["state"].values() for k in s)


def test_compressed_moments_refuse_row_cutting_placements():
    """A Shard(1) (tensor-parallel) parameter would cut groups: a clear error, not wrong states."""
    _spawn(_placement_worker, 1)


def _placement_worker(rank, world_size, store):
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _init(rank, world_size, store)
    p = torch.nn.Parameter(distribute_tensor(torch.randn(64, 256), mesh, [Shard(1)]))
    p.grad = distribute_tensor(torch.randn(64, 256), mesh, [Shard(1)])
    with pytest.raises(ValueError, match="Shard\\(0\\) or Replicate"):
        CompressedAdamW([p]).step()
    opt = CompressedAdamW([p], compress=False)
    opt.step()  # float32 moments work with any placement
    assert math.isfinite(float(p.to_local().sum()))
    # DTensor states count their local shard (the DTensor's flatten protocol also names its mesh)
    assert opt.state_bytes() == coatstate.optim.optimizer_state_bytes(opt) == 2 * p.to_local().numel() * 4
    dist.destroy_process_group()
