"""CompiledActivations: FP8 saved activations inside torch.compile'd (inductor) graphs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from coatstate.formats import activation as codec
from torch import nn

from coatstate.activations import compiled as compiled_module
from coatstate.activations.compiled import CompiledActivations
from coatstate.models import GPT, Llama, ModelConfig
from tests.conftest import requires_cuda

pytestmark = pytest.mark.slow  # inductor compiles in every test: most of the suite's CPU time


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _grads(model, idx, tgt, autocast):
    model.zero_grad(set_to_none=True)
    with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(idx, tgt)
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


def _compiled_blocks(model, options=None):
    model = copy.deepcopy(model)
    for block in model.blocks:
        block.compile(options=options)
    return model


@pytest.mark.parametrize(  # each model and each precision once (every pair: 75 s more CI on 2 cores)
    "arch,autocast", [("gpt", False), ("llama", True)], ids=["gpt-fp32", "llama-bf16"]
)
def test_gradient_fidelity_and_bytes(arch, autocast, device="cpu"):
    """Blocks compiled with the FP8 partitioner against the same blocks compiled without it."""
    cfg = ModelConfig(vocab=128, layers=2, dim=128, heads=4, seq=64, loss_chunks=1, layout="eager")
    model = {"gpt": GPT, "llama": Llama}[arch](cfg).to(device)
    idx = torch.randint(0, cfg.vocab, (4, cfg.seq), device=device)
    tgt = torch.randint(0, cfg.vocab, (4, cfg.seq), device=device)
    loss_ref, ref = _grads(_compiled_blocks(model), idx, tgt, autocast)
    torch._dynamo.reset()
    fp8 = CompiledActivations(min_numel=1024, attention="group")  # (q, k in FP8: the path under test)
    loss, got = _grads(_compiled_blocks(model, fp8.options), idx, tgt, autocast)
    cos = {n: F.cosine_similarity(ref[n].flatten(), got[n].flatten(), dim=0).item() for n in ref}
    worst = min(cos, key=cos.get)
    s = fp8.stats
    print(f"\n{arch} {'bf16' if autocast else 'fp32'} {device}: min cosine {cos[worst]:.6f} ({worst})")
    print(s.summary())
    for row in fp8.report:
        print(row)
    assert loss == pytest.approx(loss_ref, rel=1e-4)  # the forward computes the same (fused differently)
    assert cos[worst] >= 0.999, f"{worst}: cosine {cos[worst]:.6f}"
    assert s.packed_by_kind.get("attention/group", 0) >= 2, s.packed_by_kind  # q and k
    # the linears' inputs are recomputed from what is held: the norms' outputs from their inputs
    # and statistics, the MLP's hidden activation from the GELU input (SwiGLU: w1 x and w3 x)
    assert s.recomputed >= 3, fp8.report
    assert s.ratio >= 2.2, f"only {s.ratio:.2f}x smaller"  # (1.8x asked of compress_activations)
    params = [what for _, _, _, what in fp8.report if what.endswith("from its parameter")]
    assert len(params) >= 4 or not autocast, fp8.report  # autocast's bf16 weights: not saved


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_gradient_fidelity_on_gpu(arch):
    test_gradient_fidelity_and_bytes(arch, True, device="cuda")


class _TwoLinears(nn.Module):
    """The first linear's output, scaled, is the second's saved input: a per-tensor FP8 save."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 96, bias=False)
        self.b = nn.Linear(96, 32, bias=False)

    def forward(self, x):
        return self.b(self.a(x) * 1.5)


@pytest.mark.parametrize("fmt,granularity", [("e4m3", "group"), ("e5m2", "group"), ("e4m3", "tensor")])
def test_codes_are_the_eager_codecs(fmt, granularity, device="cpu"):
    """The second weight's gradient is dY^T @ decode(encode(h)): the traced codec gives the same
    bytes as coatstate.formats.activation's, so the gradient matches an eager computation."""
    model = _TwoLinears().to(device)
    x = torch.randn(8, 16, 64, device=device)
    fp8 = CompiledActivations(min_numel=0, fmt=fmt, linear=granularity)
    compiled = torch.compile(copy.deepcopy(model), options=fp8.options)
    compiled(x).square().sum().backward()
    h = model.a(x) * 1.5
    if granularity == "tensor":
        h_held = codec.unpack_tensor(*codec.pack_tensor(h, fmt), h.dtype)
    else:
        rows = h.reshape(-1, 96)
        h_held = codec.unpack_groups(*codec.pack_groups(rows, 16, fmt), 16, h.dtype).reshape(h.shape)
    dy = 2 * model.b(h)  # d(sum y^2)/dy, from the exact forward (the forward is not compressed)
    expected = dy.reshape(-1, 32).T @ h_held.reshape(-1, 96)
    got = compiled.b.weight.grad
    assert fp8.stats.packed_by_kind == {f"linear/{granularity}": 1}, fp8.report
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), (got - expected).abs().max()
    exact = dy.reshape(-1, 32).T @ h.reshape(-1, 96)
    assert not torch.allclose(got, exact, rtol=1e-6, atol=1e-6)  # it did go through FP8


@pytest.mark.gpu
@requires_cuda
def test_codes_are_the_eager_codecs_on_gpu():
    test_codes_are_the_eager_codecs("e4m3", "group", device="cuda")
    test_codes_are_the_eager_codecs("e4m3", "tensor", device="cuda")


def test_parameters_inputs_and_small_tensors_are_kept():
    fp8 = CompiledActivations()  # default min_numel: this model's tensors are all smaller
    model = _TwoLinears()
    x = torch.randn(2, 64, requires_grad=True)
    torch.compile(model, options=fp8.options)(x).sum().backward()
    assert fp8.stats.packed == 0
    reasons = fp8.stats.kept_reasons
    assert reasons["smaller than min_numel=65536"] >= 1, fp8.report
    torch._dynamo.reset()
    big = CompiledActivations(min_numel=0)
    torch.compile(model, options=big.options)(x).sum().backward()
    kept = {name: what for name, _, _, what in big.report if what.startswith("kept")}
    assert any("input of a compiled graph" in w or "parameter" in w for w in kept.values()), big.report


def test_dynamic_shapes_are_kept_and_reported():
    fp8 = CompiledActivations(min_numel=0)
    model = _TwoLinears()
    compiled = torch.compile(model, options=fp8.options, dynamic=True)
    compiled(torch.randn(5, 64)).sum().backward()
    assert fp8.stats.kept_reasons["dynamic (symbolic) shape in a compiled graph"] >= 1, fp8.report
    assert fp8.stats.packed == 0


def test_bad_arguments_name_the_problem():
    with pytest.raises(TypeError, match="unknown option"):
        CompiledActivations(grup_size=16)
    with pytest.raises(TypeError, match="ActivationPolicy"):
        CompiledActivations(policy={"fmt": "e4m3"})
    with pytest.raises(ValueError, match="group_size"):
        CompiledActivations(group_size=12)


def test_cache_key_follows_the_policy():
    assert CompiledActivations().uuid() == CompiledActivations().uuid()
    assert CompiledActivations().uuid() != CompiledActivations(fmt="e5m2").uuid()
    assert CompiledActivations().options["fx_graph_cache"] is False  # (AOTAutograd's cache needs it too)
    assert "fx_graph_cache" not in CompiledActivations(cache=True).options


def test_stats_are_filled_on_every_compile():
    """With the default cache=False the partitioner runs (and reports) even for a graph compiled
    before in this process or an earlier one."""
    model, x = _TwoLinears(), torch.randn(8, 64)
    for _ in range(2):
        torch._dynamo.reset()
        fp8 = CompiledActivations(min_numel=0)
        torch.compile(model, options=fp8.options)(x * 1.0).sum().backward()
        assert fp8.stats.packed_by_kind == {"linear/tensor": 1}, fp8.report


def test_an_unrecognised_graph_layout_is_left_alone_with_a_warning(monkeypatch):
    """If the backward's inputs do not line up with the forward's saved tensors, nothing is edited:
    the graph runs uncompressed (gradients exact) and the partitioner says so."""
    import coatstate.activations.compiled as ac

    partition = ac.min_cut_rematerialization_partition

    def renamed(*args, **kwargs):
        fw, bw = partition(*args, **kwargs)
        bw.graph.find_nodes(op="placeholder")[0].name = "not_a_forward_node"
        return fw, bw

    monkeypatch.setattr(ac, "min_cut_rematerialization_partition", renamed)
    model, x = _TwoLinears(), torch.randn(8, 64)
    fp8 = CompiledActivations(min_numel=0)
    with pytest.warns(UserWarning, match="left a compiled graph's saved tensors as they are"):
        torch.compile(model, options=fp8.options)(x * 1.0).sum().backward()
    assert fp8.stats.kept_reasons["graph layout not recognised (warned)"] == 1
    assert fp8.stats.packed == 0
    ref = copy.deepcopy(model)
    ref.zero_grad()
    ref(x).sum().backward()
    torch.testing.assert_close(model.b.weight.grad, ref.b.weight.grad)


def test_whole_model_as_one_graph(device="cpu"):
    """One graph for the whole GPT (embeddings, blocks, the checkpointed chunked loss): the codes
    are made inside the forward and decoded next to their use, so unlike hooks around a compiled
    call nothing waits until the graph returns; gradients stay as close as per block. (One layer:
    the graph's size, not the layer count, is what this checks, and compiling it is slow on CPU.)"""
    cfg = ModelConfig(vocab=128, layers=1, dim=128, heads=4, seq=64, loss_chunks=2)
    model = GPT(cfg).to(device)
    idx = torch.randint(0, cfg.vocab, (4, cfg.seq), device=device)
    _, ref = _grads(torch.compile(copy.deepcopy(model)), idx, idx, True)
    torch._dynamo.reset()
    fp8 = CompiledActivations(min_numel=1024, attention="group")
    _, got = _grads(torch.compile(copy.deepcopy(model), options=fp8.options), idx, idx, True)
    worst = min(F.cosine_similarity(ref[n].flatten(), got[n].flatten(), dim=0).item() for n in ref)
    print(f"\nwhole GPT as one graph: min cosine {worst:.6f}\n{fp8.stats.summary()}")
    assert worst >= 0.999
    assert fp8.stats.packed_by_kind.get("attention/group", 0) >= 2 * cfg.layers, fp8.report
    assert fp8.stats.kept_reasons["policy keeps attention_v_out"] >= 1, fp8.report  # the outputs


@pytest.mark.gpu
@requires_cuda
def test_whole_model_as_one_graph_on_gpu():
    test_whole_model_as_one_graph(device="cuda")


def test_fsdp2_with_compiled_blocks():
    """FSDP2 (2 ranks, gloo) with each block sharded and then compiled, torchtitan's recipe: the
    partitioner sees the unsharded parameters as graph inputs; gradients match the same setup
    without it."""
    from tests.integration.test_fsdp2_ddp import _spawn

    _spawn(_fsdp2_worker, 2)


def _fsdp2_worker(rank, world_size, port):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from tests.integration.test_fsdp2_ddp import _init

    mesh = _init(rank, world_size, port)
    cfg = ModelConfig(vocab=128, layers=2, dim=128, heads=4, seq=64, loss_chunks=1)
    torch.manual_seed(0)
    base = GPT(cfg)
    idx = torch.randint(0, cfg.vocab, (2, cfg.seq), generator=torch.Generator().manual_seed(rank))
    grads = []
    for fp8 in (None, CompiledActivations(min_numel=1024, attention="group")):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
            block.compile(options=fp8.options if fp8 else None)
        fully_shard(model, mesh=mesh)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(idx, idx).backward()
        grads.append({n: p.grad.full_tensor().float() for n, p in model.named_parameters()})
    worst = min(
        F.cosine_similarity(grads[0][n].flatten(), grads[1][n].flatten(), dim=0).item() for n in grads[0]
    )
    assert fp8.stats.packed >= 3 and fp8.stats.recomputed >= 2, fp8.report
    assert worst >= 0.999, worst
    dist.destroy_process_group()


def test_cudagraphs_option_turns_cuda_graphs_on_and_changes_nothing_else(device="cpu", steps=1):
    """CompiledActivations(cudagraphs=True) asks inductor for CUDA graphs (reduce-overhead's
    option). The FP8 codes are plain outputs of the forward graph, so with graphs recorded and
    replayed (steps >= 3 on CUDA: warm-up, recording, replays) every step's gradients equal, bit
    for bit, those of the same blocks compiled without graphs. On CPU inductor leaves graphs out,
    so there only the options are checked (the CUDA test runs the rest)."""
    assert CompiledActivations(cudagraphs=True).options["triton.cudagraphs"] is True
    assert "triton.cudagraphs" not in CompiledActivations().options
    if device == "cpu":
        return
    cfg = ModelConfig(vocab=128, layers=2, dim=128, heads=4, seq=64, loss_chunks=1)
    model = GPT(cfg).to(device)
    batches = [torch.randint(0, cfg.vocab, (2, cfg.seq), device=device) for _ in range(steps)]
    runs = []
    again = (False,) if device == "cuda" else ()  # is the plain path itself deterministic there?
    for cudagraphs in (False, True, *again):
        torch._dynamo.reset()
        fp8 = CompiledActivations(min_numel=1024, cudagraphs=cudagraphs)
        compiled = _compiled_blocks(model, fp8.options)
        per_step = []
        for idx in batches:
            torch.compiler.cudagraph_mark_step_begin()
            per_step.append(_grads(compiled, idx, idx, True)[1])
        runs.append((per_step, fp8.report))
    (plain, report), (graphed, report_cg) = runs[:2]
    repeat = runs[2][0] if again else plain
    assert report == report_cg  # the same partitioning
    for step, (a, b, c) in enumerate(zip(plain, graphed, repeat, strict=True)):
        for name in a:
            # bit for bit where the plain path repeats itself bit for bit (CPU; on CUDA unless an
            # op such as attention's backward accumulates with atomics), else within its own noise
            noise = (a[name] - c[name]).abs().max()
            diff = (a[name] - b[name]).abs().max()
            assert diff <= 2 * noise, f"step {step} {name}: {diff} (plain run to run: {noise})"


@pytest.mark.gpu
@requires_cuda
def test_cudagraphs_option_on_gpu():
    from torch._dynamo.utils import counters

    counters.clear()
    test_cudagraphs_option_turns_cuda_graphs_on_and_changes_nothing_else(device="cuda", steps=4)
    assert counters["inductor"]["cudagraph_skips"] == 0, "a graph ran without CUDA graphs (see the log)"


def test_fused_consumers_change_nothing_but_kernels(device="cpu"):
    """Two edits that only change kernels: fuse_consumers (activations/consumer_fusion.py) routes
    GPT's GELU output and Llama's SiLU * up through their packs' scale bytes so that inductor
    fuses each pack into that kernel, and GPT's q, k and v, views that tile one qkv buffer, are
    packed as that buffer, once (the same groups of 16). With both on, against both off: on CPU
    loss and every gradient are equal, bit for bit. On CUDA the fused kernel is a different
    kernel (its compiler may contract a multiply-add differently), so there a bfloat16 rounding
    of the forward may differ: the loss agrees to 1e-3 and each gradient within its own
    run-to-run noise plus 2**-7 of its largest value (one bfloat16 step)."""
    cfg = ModelConfig(vocab=128, layers=1, dim=128, heads=4, seq=64, loss_chunks=1, layout="eager")
    for arch in ("gpt", "llama"):
        model = {"gpt": GPT, "llama": Llama}[arch](cfg).to(device)
        idx = torch.randint(0, cfg.vocab, (2, cfg.seq), device=device)
        runs = []
        again = (False,) if device == "cuda" else ()  # (CPU repeats itself bit for bit)
        for fuse in (False, True, *again):
            torch._dynamo.reset()
            fp8 = CompiledActivations(min_numel=1024, attention="group", fuse_consumers=fuse)
            with pytest.MonkeyPatch.context() as mp:
                if not fuse:  # (views packed one by one, as before the shared pack)
                    mp.setattr(compiled_module._Rewrite, "_merge_shared", lambda self, packs: packs)
                runs.append((_grads(_compiled_blocks(model, fp8.options), idx, idx, True), fp8))
        (loss, plain), off = runs[0]
        (loss_fused, fused), on = runs[1]
        repeat = runs[2][0][1] if again else plain
        assert on.consumers_fused == 1 and off.consumers_fused == 0, arch  # (one MLP per block)
        assert on.buffers_shared == (arch == "gpt") and off.buffers_shared == 0, arch  # (qkv)
        assert on.report == off.report  # the same tensors held the same way
        cuda = device == "cuda"
        assert loss_fused == pytest.approx(loss, rel=1e-3) if cuda else loss_fused == loss
        for name in plain:
            noise = (plain[name] - repeat[name]).abs().max()
            diff = (plain[name] - fused[name]).abs().max()
            allowed = 2 * noise + (2**-7 * plain[name].abs().max() if cuda else 0)
            assert diff <= allowed, f"{arch} {name}: {diff} (plain run to run: {noise})"


@pytest.mark.gpu
@requires_cuda
def test_fused_consumers_on_gpu():
    test_fused_consumers_change_nothing_but_kernels(device="cuda")


class _SplitInTwo(nn.Module):
    """A projection split along its last dim into two pieces, each the input of its own linear
    (per-group policy): `widths` decides whether the pieces are whole groups of 16 wide."""

    def __init__(self, widths) -> None:
        super().__init__()
        self.widths = widths
        self.proj = nn.Linear(32, 32, bias=False)
        self.a, self.b = nn.Linear(widths[0], 8, bias=False), nn.Linear(widths[1], 8, bias=False)

    def forward(self, x):
        pa, pb = self.proj(x).split(list(self.widths), dim=-1)
        return self.a(pa) + self.b(pb)


@pytest.mark.parametrize("widths,shared", [((16, 16), 1), ((8, 24), 0)])
def test_a_split_buffer_is_packed_once_only_where_groups_stay_its_pieces(widths, shared):
    """The pieces of one split are packed as the buffer they tile, once, only where no group of
    16 spans two pieces: with pieces 8 and 24 wide a large value in one would set the other's
    scale. Where the buffer is packed once, the gradients are those of the pieces packed one by
    one, bit for bit."""
    torch.manual_seed(0)
    model = _SplitInTwo(widths)
    x = torch.randn(64, 32)
    x[0, 0] = 2.0**12  # (a large value: with shared groups it would show)
    runs = []
    for merge in (True, False)[: 1 + shared]:
        torch._dynamo.reset()
        fp8 = CompiledActivations(min_numel=0, linear="group")
        compiled = torch.compile(copy.deepcopy(model), options=fp8.options)
        with pytest.MonkeyPatch.context() as mp:
            if not merge:
                mp.setattr(compiled_module._Rewrite, "_merge_shared", lambda self, packs: packs)
            compiled(x).square().sum().backward()
        runs.append({n: p.grad for n, p in compiled.named_parameters()})
        assert fp8.buffers_shared == (shared if merge else 0)
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[-1][name]), name


def test_default_keeps_q_and_k_and_labels_the_gelu_input_under_autocast(device="cpu"):
    """By default attention's q and k (and the v that shares their qkv storage) stay as they are:
    FP8 q and k shrink attention's gradients (ActivationPolicy.attention). Under bf16 autocast the
    MLP's pre-GELU tensor reaches tanh through a view and a cast, and is still an activation:
    `activation="keep"` keeps it."""
    cfg = ModelConfig(vocab=128, layers=1, dim=128, heads=4, seq=64, loss_chunks=1)
    model = GPT(cfg).to(device)
    idx = torch.randint(0, cfg.vocab, (4, cfg.seq), device=device)
    fp8 = CompiledActivations(min_numel=1024)
    _grads(_compiled_blocks(model, fp8.options), idx, idx, True)
    assert fp8.stats.kept_reasons["policy keeps attention"] >= 2, fp8.report
    assert not any(k.startswith("attention") for k in fp8.stats.packed_by_kind), fp8.stats.packed_by_kind
    assert fp8.stats.packed_by_kind.get("activation/group", 0) == 1, fp8.stats.packed_by_kind
    torch._dynamo.reset()
    keep = CompiledActivations(min_numel=1024, activation="keep")
    _grads(_compiled_blocks(model, keep.options), idx, idx, True)
    assert keep.stats.kept_reasons["policy keeps activation"] >= 1, keep.report
    assert "activation/group" not in keep.stats.packed_by_kind, keep.stats.packed_by_kind


def _held_storage_bytes(model, idx):
    """Grads, and the bytes of the distinct storages the compiled blocks hold for backward."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, grads = _grads(model, idx, idx, True)
    return grads, sum(storages.values())


def test_a_view_that_would_pin_its_buffer_is_held_as_a_compact_copy(monkeypatch, device="cpu"):
    """Llama's attention rotates q and k into new tensors, so the saved v is the only view left of
    the qkv projection: held as it is, it would keep all three thirds alive until backward. v is
    held as a copy of its own elements instead: two thirds of the buffer fewer bytes, the same
    gradients bit for bit."""
    cfg = ModelConfig(vocab=128, layers=1, dim=128, heads=4, seq=64, loss_chunks=1)  # fused qkv
    model = Llama(cfg).to(device)
    idx = torch.randint(0, cfg.vocab, (4, cfg.seq), device=device)
    runs = []
    for compact in (True, False):
        torch._dynamo.reset()
        fp8 = CompiledActivations(min_numel=1024)
        if not compact:
            monkeypatch.setattr(compiled_module, "pinning_views", lambda *args: set())
        runs.append(_held_storage_bytes(_compiled_blocks(model, fp8.options), idx))
        copies = [r for r in fp8.report if r[3].endswith("(a compact copy)")]
        assert len(copies) == (1 if compact else 0), fp8.report
    (grads, held), (grads_pinned, held_pinned) = runs
    qk_bytes = 2 * 4 * cfg.seq * cfg.dim * 2  # q's and k's thirds of the bf16 qkv buffer
    assert held_pinned - held == qk_bytes
    for name in grads:
        assert torch.equal(grads[name], grads_pinned[name]), name
