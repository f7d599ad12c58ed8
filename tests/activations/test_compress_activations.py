"""compress_activations: policy traps, gradient fidelity, bytes (the codec's kernels against their
twins: tests/kernels/test_activation_kernels.py)."""

from __future__ import annotations

import contextlib
import gc
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from coatstate.activations import ActivationPolicy, compress_activations
from coatstate.models import GPT, Llama, ModelConfig, RMSNorm
from tests.conftest import requires_cuda

ROOT = Path(__file__).resolve().parents[2]


def test_policy_validation():
    with pytest.raises(ValueError, match="linear='fp4'"):
        ActivationPolicy(linear="fp4")
    with pytest.raises(ValueError, match="group_size"):
        ActivationPolicy(group_size=12)
    with pytest.raises(ValueError, match="unknown FP8 format"):
        ActivationPolicy(fmt="e3m4")
    with pytest.raises(TypeError, match="unknown option"):
        compress_activations(granularity="group")
    with pytest.raises(ValueError, match="recompute"):
        ActivationPolicy(recompute="yes")
    p = ActivationPolicy(norm="tensor", fmt="e5m2")
    assert p.norm.value == "tensor" and p.fmt.value == "e5m2"


def codec_no_grad_fn() -> str:
    return "no grad_fn (buffers, frozen parameters, statistics such as mean, rstd, logsumexp)"


def _linear_input():
    lin = nn.Linear(64, 64)
    x = torch.randn(8, 64)
    return lin, lin(x)  # a non-leaf activation


def test_pack_hook_detaches_and_makes_no_cycle():
    gc.disable()
    try:
        x = torch.randn(8, 64, requires_grad=True)
        with compress_activations(min_numel=0, activation="keep", other="keep") as ctx:
            h = x * 2
            y = torch.sigmoid(h)  # saves its own output: a hook that does not detach makes a cycle
            kept = ctx._pack(h)
        assert not kept.tensor.requires_grad and kept.tensor.grad_fn is None
        ref = weakref.ref(y)
        del y, h
        assert ref() is None, "the saved output keeps itself alive (reference cycle through grad_fn)"
    finally:
        gc.enable()


def test_parameters_buffers_inputs_never_compressed():
    torch.manual_seed(0)
    model = Llama(ModelConfig(vocab=64, layers=1, dim=64, heads=2, seq=32, layout="eager"))
    lin = nn.Linear(64, 64)
    x = torch.randn(4, 64, requires_grad=True)
    h = x * 2  # made before the context: alive anyway
    with compress_activations(min_numel=0) as ctx:
        lin(x).sum().backward()  # saves only its input (a leaf) and the weight
        lin(h).sum().backward()
    assert ctx.stats.packed == 0, ctx.stats.summary()
    reasons = ctx.stats.kept_reasons
    assert reasons["parameter or other leaf requiring grad"] == 1, reasons  # x
    assert reasons["parameter cast or view"] == 2, reasons  # lin.weight.t()
    assert reasons["created before the context"] == 1, reasons
    params = {p.untyped_storage().data_ptr() for p in (*model.parameters(), *model.buffers())}
    with compress_activations(min_numel=0) as ctx, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32)))
        held = set(ctx._regions)  # storages that hold compressed or policy-kept regions
    loss.backward()
    print(ctx.stats.summary())
    assert ctx.stats.packed > 0
    assert ctx.stats.kept_reasons["parameter or other leaf requiring grad"] > 0  # norm weights
    assert ctx.stats.kept_reasons[codec_no_grad_fn()] > 0  # RoPE's cos/sin buffer slices
    assert ctx.stats.kept_reasons["parameter cast or view"] > 0  # autocast's bf16 weights
    assert not held & params


def test_same_memory_saved_by_several_ops_and_views_is_compressed_once():
    lin = nn.Linear(64, 64)
    x = torch.randn(8, 64)

    def loss():
        h = lin(x).view(8, 4, 16)  # sin, cos and sin again save h, a reshape and a transpose of it
        return torch.sin(h).sum() + torch.cos(h.reshape(32, 16)).sum() + torch.sin(h.transpose(0, 1)).sum()

    with compress_activations(min_numel=0) as ctx:
        y = loss()
    y.backward()
    assert ctx.stats.packed == 1 and ctx.stats.shared == 2, ctx.stats.summary()
    g = lin.weight.grad.clone()
    lin.weight.grad = None
    loss().backward()
    cos = F.cosine_similarity(g.flatten(), lin.weight.grad.flatten(), dim=0)
    assert cos > 0.999, f"cosine {cos:.5f}"


def test_views_of_one_storage_are_packed_once_and_unpacked_once():
    """q, k and v split from one qkv projection: the storage is packed once (not three strided
    copies), and backward unpacks it once for the three (a weak cache)."""
    torch.manual_seed(0)
    qkv_proj = nn.Linear(32, 96)
    x = torch.randn(2, 16, 32)

    def attention():
        q, k, v = qkv_proj(x).split(32, dim=2)
        q, k, v = (t.view(2, 16, 2, 16).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum()

    attention().backward()
    ref = qkv_proj.weight.grad.clone()
    qkv_proj.weight.grad = None
    with compress_activations(min_numel=0, attention="group", attention_v_out="group") as ctx:
        loss = attention()
    unpacked = []
    real = ctx._region_values
    ctx._region_values = lambda region: unpacked.append(region.cached() is None) or real(region)
    loss.backward()
    print(ctx.stats.summary())
    assert ctx.stats.packed_by_kind["attention/group"] == 1, ctx.stats.packed_by_kind
    assert ctx.stats.shared >= 2
    assert unpacked.count(True) == 1 + 2  # the qkv storage once; the output and the linear's input
    cos = F.cosine_similarity(ref.flatten(), qkv_proj.weight.grad.flatten(), dim=0)
    assert cos > 0.999, f"cosine {cos:.5f}"


def test_attention_q_and_k_are_packed_v_kept_with_exact_gradients():
    """Separate q, k, v (saved before the op's output tells them apart): q and k are held per
    group, v and the output as they are (the default policy); the gradients equal, bit for bit,
    those of autograd run on the same held values put in by plain saved-tensor hooks."""
    from coatstate.formats import activation as codec

    torch.manual_seed(0)
    wq, wk, wv = (torch.randn(32, 32, requires_grad=True) for _ in range(3))
    x = torch.randn(2, 64, 32)

    def attention():
        q, k, v = ((x @ w).view(2, 64, 2, 16).transpose(1, 2) for w in (wq, wk, wv))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum(), q, k

    def grads():
        out = [w.grad.clone() for w in (wq, wk, wv)]
        for w in (wq, wk, wv):
            w.grad = None
        return out

    with compress_activations(min_numel=0, attention="group") as ctx:
        loss, _, _ = attention()
    loss.backward()
    got = grads()
    assert ctx.stats.packed_by_kind["attention/group"] == 2, ctx.stats.packed_by_kind
    assert ctx.stats.kept_reasons["policy keeps attention_v_out"] == 2, ctx.stats.kept_reasons

    held_ids = []

    def pack(t):  # q and k through the codec, in the layout the hooks pack (rows of their last dim)
        if any(t is h for h in held_ids):
            rows = t.contiguous().reshape(-1, t.shape[-1])
            return codec.unpack_groups(*codec.pack_groups(rows, 16), 16, t.dtype).view(t.shape)
        return t

    real_sdpa = F.scaled_dot_product_attention

    def sdpa(q, k, v, **kw):
        held_ids[:] = [q, k]
        return real_sdpa(q, k, v, **kw)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.scaled_dot_product_attention = sdpa
        try:
            loss, _, _ = attention()
        finally:
            F.scaled_dot_product_attention = real_sdpa
    loss.backward()
    for a, b in zip(got, grads(), strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
    attention()[0].backward()
    exact = grads()
    assert not torch.equal(got[0], exact[0]) and not torch.equal(got[1], exact[1])  # q, k did go through FP8


def test_activation_output_is_recomputed_not_stored():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(approximate="tanh"), nn.Linear(256, 64))
    x = torch.randn(32, 64)
    mlp(x).square().sum().backward()
    ref = [p.grad.clone() for p in mlp.parameters()]
    stats = {}
    for recompute in (True, False):
        mlp.zero_grad()
        with compress_activations(min_numel=0, recompute=recompute) as ctx:
            loss = mlp(x).square().sum()
        loss.backward()
        worst = min(
            F.cosine_similarity(a.flatten(), p.grad.flatten(), dim=0).item()
            for a, p in zip(ref, mlp.parameters(), strict=True)
        )
        stats[recompute] = ctx.stats
        print(f"recompute={recompute}: min cosine {worst:.6f}; {ctx.stats.summary()}")
        assert worst > 0.999
    assert stats[True].recomputed == 1 and stats[False].recomputed == 0
    # without recomputation the GELU output is packed per tensor: 1 byte per element + 1 scale byte
    assert stats[False].bytes_packed - stats[True].bytes_packed == 32 * 256 + 1
    assert stats[True].activation_bytes_original == stats[False].activation_bytes_original


def test_op_kinds_come_from_call_sites_without_a_torch_function_mode():
    """The kind is read off the Python call running the op (F.linear, `@`, x.softmax, ...) and,
    for ops that say nothing (the muls of a hand-written RMSNorm), off the module on the stack;
    nothing hooks every torch call."""
    torch.manual_seed(0)
    lin, norm = nn.Linear(64, 64), RMSNorm(64)
    w = nn.Parameter(torch.randn(64, 64))
    x, target = torch.randn(32, 64), torch.randint(0, 64, (32,))
    with compress_activations(min_numel=0, other="keep") as ctx:
        assert not torch._C._is_torch_function_mode_enabled()
        h = [lin(x) + i for i in range(7)]  # seven distinct activations
        loss = (
            (h[0] @ w).sum()  # linear: an operator
            + torch.matmul(h[1], w).sum()  # linear: a torch function
            + F.layer_norm(h[2], (64,)).sum()  # norm: a Python function calling torch.layer_norm
            + h[3].softmax(-1).square().sum()  # activation (saves its output)
            + norm(h[4]).sum()  # norm by the module: pow saves h, rsqrt its output, mul h*r
            + torch.sin(h[5]).sum()  # other: kept by this policy
            + F.cross_entropy(h[6], target)  # loss: its log-probabilities kept
        )
    loss.backward()
    print(ctx.stats.summary(), dict(ctx.stats.packed_by_kind))
    # (the square's input is the softmax output: shared, not packed again)
    assert dict(ctx.stats.packed_by_kind) == {"linear/tensor": 2, "norm/bf16": 4, "activation/group": 1}
    reasons = ctx.stats.kept_reasons
    assert reasons["policy keeps other"] >= 1 and reasons["policy keeps loss"] == 1, reasons


def test_call_site_kind_with_python_level_callees():
    """A frame that called a Python function reports an offset inside the call's inline caches
    (3.11, 3.12): the site is still the call. Multi-line calls and method chains resolve to the
    name called last."""
    from coatstate.activations.op_kinds import OpKind, kind_of_call_site

    seen = []

    def record(*args, **kwargs):
        frame = sys._getframe(1)
        seen.append(kind_of_call_site(frame.f_code, frame.f_lasti))
        return types.SimpleNamespace(softmax=record)

    linear, layer_norm, scaled_dot_product_attention = record, record, record
    linear(1, 2)
    scaled_dot_product_attention(
        1,
        2,
        is_causal=True,
    )
    layer_norm(3).softmax(-1)
    types.SimpleNamespace(sin=record).sin(1)
    want = [OpKind.LINEAR, OpKind.ATTENTION, OpKind.NORM, OpKind.ACTIVATION, OpKind.OTHER]
    if sys.version_info < (3, 11):  # no source positions in the bytecode: every site is OTHER
        want = [OpKind.OTHER] * len(want)
    assert seen == want, seen


def test_math_attention_keeps_inputs_and_in_place_change_raises():
    """The math backend saves no output of its own, so q/k cannot be told from v: its saves are
    held as attention_v_out (kept by default), and an in-place change of one before backward raises
    as autograd would."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 32, 16, requires_grad=True) for _ in range(3))
    for modify in (False, True):
        qq, kk, vv = q * 1, k * 1, v * 1
        with sdpa_kernel(SDPBackend.MATH), compress_activations(min_numel=0) as ctx:
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
            if modify:
                vv.add_(1.0)
        loss = out.square().sum()
        if modify:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss.backward()
            continue
        loss.backward()
        assert ctx.stats.packed == 0 and ctx.stats.kept_reasons["policy keeps attention_v_out"] > 0
        with sdpa_kernel(SDPBackend.MATH):
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum()
        assert torch.equal(q.grad, torch.autograd.grad(ref, q)[0]), "kept tensors must give exact gradients"


def test_integer_and_bool_tensors_pass_through():
    emb = nn.Embedding(100, 32)
    idx = torch.randint(0, 100, (4, 1000))
    with compress_activations(min_numel=0) as ctx:
        h = emb(idx) * 1.0
        mask = h > 0
        out = torch.where(mask, h, 0.0).gather(1, idx[:, :, None].expand(-1, -1, 1) % 32)
    out.sum().backward()
    reasons = ctx.stats.kept_reasons
    print(ctx.stats.summary())
    assert reasons["not float16/bfloat16/float32"] + reasons["module input"] >= 2, reasons
    assert emb.weight.grad is not None


class _SaveAny(torch.autograd.Function):
    """Saves a tensor of any dtype next to its input, as an FP8 linear layer saves its FP8 copy."""

    @staticmethod
    def forward(ctx, x, other):
        ctx.save_for_backward(other)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (other,) = ctx.saved_tensors
        assert other.dtype in (torch.float8_e4m3fn, torch.uint8)
        return grad * 2, None


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8])
def test_fp8_and_uint8_tensors_pass_through_uncompressed(dtype):
    x = torch.randn(64, 1024, requires_grad=True)
    other = (torch.randn(64, 1024) * 0.5).to(dtype)
    with compress_activations(min_numel=0) as ctx:
        y = _SaveAny.apply(x * 1, other)
    y.sum().backward()
    assert ctx.stats.packed == 0 and ctx.stats.kept_reasons["not float16/bfloat16/float32"] == 1


def test_inplace_change_of_a_kept_tensor_raises():
    lin, h = _linear_input()
    with compress_activations(min_numel=0, other="keep"):
        y = torch.sin(h).sum()  # h kept uncompressed by policy
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_non_reentrant_checkpoint():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab=64, layers=2, dim=64, heads=2, seq=32, loss_chunks=4)
    model = GPT(cfg)
    idx = torch.randint(0, 64, (2, 32))
    model(idx, idx).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    for backward_inside in (False, True):
        model.zero_grad()
        with compress_activations(min_numel=0) as ctx:
            loss = model(idx, idx)
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        worst = min(
            F.cosine_similarity(a.flatten(), p.grad.flatten(), dim=0).item()
            for a, p in zip(ref, model.parameters(), strict=False)
        )
        print(f"checkpointed loss, backward inside={backward_inside}: min cosine {worst:.6f}")
        assert ctx.stats.packed > 0 and worst > 0.999


@pytest.mark.slow
@pytest.mark.parametrize("where", ["outside", "inside", "outside, inductor"])
def test_torch_compile_works_or_raises_clearly(where):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(32, 64)
    model(x).square().sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    # float32 model: a compiled graph's float32 saves are kept unless compiled_fp32 says otherwise
    options = {"min_numel": 0, "compiled_fp32": "group"}
    try:
        if where.startswith("outside"):
            compiled = torch.compile(model, backend="inductor" if "inductor" in where else "aot_eager")
            with compress_activations(**options) as ctx:
                loss = compiled(x).square().sum()
        else:
            ctx = compress_activations(**options)

            def step(x):
                with ctx:
                    return model(x).square().sum()

            loss = torch.compile(step, backend="aot_eager")(x)
        loss.backward()
    except Exception as e:  # dynamo wraps errors raised while tracing
        assert "compress_activations" in str(e), f"unclear error: {e!r}"
        print(f"{where}: raised a clear error")
        return
    assert ctx.stats.packed > 0, f"{where}: silent no-op, nothing was compressed"
    assert ctx.stats.kept_reasons.get("input of a compiled graph", 0) + ctx.stats.kept_reasons.get(
        "created before the context", 0
    ), "the graph's input x (alive anyway) must be kept, not compressed"
    worst = min(
        F.cosine_similarity(a.flatten(), p.grad.flatten(), dim=0).item()
        for a, p in zip(ref, model.parameters(), strict=False)
    )
    print(f"{where}: compressed {ctx.stats.packed} tensors, min cosine {worst:.6f}")
    assert worst > 0.999


@pytest.mark.slow
def test_compiled_graph_under_autocast_packs_16bit_saves_and_warns_about_float32(monkeypatch):
    """Inductor's graph saves everything without grad_fn: the 16-bit activations are packed, the
    parameters' bf16 casts kept (as eager keeps them), float32 saves kept with a warning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(48, 64)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    from coatstate.activations import hooks as activations

    monkeypatch.setitem(activations._WARNED, "compiled_fp32", False)  # (warned once per process)
    with pytest.warns(UserWarning, match="compiled_fp32"):
        with compress_activations(min_numel=0) as ctx:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = compiled(x).float().square().sum()
    loss.backward()
    reasons = ctx.stats.kept_reasons
    print(ctx.stats.summary())
    assert ctx.stats.packed_by_kind.get("compiled/group", 0) > 0
    assert reasons["parameter cast or view"] >= 1  # the second weight's bf16 cast (x needs no grad)
    assert reasons["policy keeps compiled_fp32"] >= 1  # the LayerNorm's float32 input


def _grads(model, idx, tgt, ctx, autocast):
    model.zero_grad(set_to_none=True)
    amp = torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=autocast)
    if ctx is None:
        with amp:
            loss = model(idx, tgt)
    else:
        with ctx, amp:
            loss = model(idx, tgt)
    loss.backward()
    return {n: p.grad.clone().float() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "arch,autocast",
    [("gpt", False), ("llama", False), ("gpt", True), ("llama", True)],
    ids=["gpt-fp32", "llama-fp32", "gpt-bf16", "llama-bf16"],
)
def test_gradient_fidelity_and_bytes(arch, autocast, device="cpu"):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab=128, layers=2, dim=128, heads=4, seq=64, layout="eager")
    model = {"gpt": GPT, "llama": Llama}[arch](cfg).to(device)
    idx = torch.randint(0, cfg.vocab, (4, cfg.seq), device=device)
    tgt = torch.randint(0, cfg.vocab, (4, cfg.seq), device=device)
    ref = _grads(model, idx, tgt, None, autocast)
    ctx = compress_activations(min_numel=1024)
    got = _grads(model, idx, tgt, ctx, autocast)
    cos = {n: F.cosine_similarity(ref[n].flatten(), got[n].flatten(), dim=0).item() for n in ref}
    worst = min(cos, key=cos.get)
    s = ctx.stats
    print(
        f"\n{arch} {'bf16 autocast' if autocast else 'fp32'} on {device}: min cosine {cos[worst]:.6f} "
        f"({worst}); saved activations {s.activation_bytes_original} B -> {s.activation_bytes_held} B "
        f"held ({s.ratio:.2f}x smaller)\n{s.summary()}"
    )
    assert cos[worst] >= 0.999, f"{worst}: cosine {cos[worst]:.6f}"
    assert s.ratio >= 1.8, f"only {s.ratio:.2f}x smaller"
    assert s.recomputed == cfg.layers, "GELU/SiLU outputs (saved through a reshape by GPT) not recomputed"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_gradient_fidelity_on_gpu(arch):
    test_gradient_fidelity_and_bytes(arch, True, device="cuda")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_compiled_model_on_cuda_packs_with_the_kernels(arch):
    """Inductor on CUDA, bf16 autocast, the context outside the compiled call: the graph's 16-bit
    saves go through the Triton pack kernels; gradients stay close to the uncompressed compiled
    model's (the compiled policy cannot keep attention's v/out as eager does: bound 0.998)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab=512, layers=2, dim=256, heads=4, seq=256, layout="eager")
    model = (GPT if arch == "gpt" else Llama)(cfg).cuda()
    idx = torch.randint(0, cfg.vocab, (4, cfg.seq), device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(model)

    def grads(ctx):
        model.zero_grad(set_to_none=True)
        with ctx, torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(idx, idx)
        loss.backward()
        return [p.grad.float().clone() for p in model.parameters()]

    ref = grads(contextlib.nullcontext())
    ctx = compress_activations(compiled_fp32="bf16")
    got = grads(ctx)
    print(ctx.stats.summary())
    assert ctx.stats.packed_by_kind.get("compiled/group", 0) > 0
    pairs = zip(ref, got, strict=True)
    worst = min(F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item() for a, b in pairs)
    print(f"{arch}: compiled on CUDA, min per-parameter cosine {worst:.6f}")
    assert worst > 0.998


def test_eager_activation_before_a_compiled_block():
    """An eager GELU notes its input as a recompute source; the compiled block after it saves
    tensors without grad_fn, which must not be looked up as outputs of that GELU."""
    torch.manual_seed(0)
    pre = nn.Sequential(nn.Linear(32, 64), nn.GELU())
    block = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    x = torch.randn(48, 32)  # (48 tokens: no activation has a weight's shape)
    block(pre(x) * 0.5).square().sum().backward()  # (the GELU's output itself is never saved)
    ref = [p.grad.clone() for p in [*pre.parameters(), *block.parameters()]]
    for p in [*pre.parameters(), *block.parameters()]:
        p.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(block)
    with compress_activations(min_numel=0, compiled_fp32="group") as ctx:
        loss = compiled(pre(x) * 0.5).square().sum()
    loss.backward()
    got = [p.grad for p in [*pre.parameters(), *block.parameters()]]
    worst = min(
        F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item() for a, b in zip(ref, got, strict=True)
    )
    print(ctx.stats.summary(), f"min cosine {worst:.6f}")
    assert ctx.stats.packed_by_kind.get("compiled_fp32/group", 0) > 0 and worst > 0.999


def test_stats_read_inside_the_context_count_each_save_once():
    """Saves are logged and counted when ctx.stats is read: read mid-forward (as the planner's trace
    does), twice, and after the context, the counts are those of counting as they happen."""
    lin = nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)
    with compress_activations(min_numel=0) as ctx:
        h = lin(x)  # keeps x (a leaf) and the weight's transpose
        first = (ctx.stats.kept, ctx.stats.packed, dict(ctx.stats.kept_reasons))
        assert (ctx.stats.kept, ctx.stats.packed) == first[:2] == (2, 0), ctx.stats.summary()
        loss = torch.sin(h).sum()  # packs h
    loss.backward()
    stats = ctx.stats
    assert (stats.kept, stats.packed, dict(stats.kept_reasons)) == (2, 1, first[2]), stats.summary()
    assert stats.bytes_original == h.numel() * 4 and stats.packed_by_kind == {"other/group": 1}
    assert stats.bytes_kept == {
        "parameter or other leaf requiring grad": x.numel() * 4,
        "parameter cast or view": 64 * 64 * 4,
    }


def test_kernel_launch_keys_determine_the_launchers_own():
    """The flat launchers key each launch by its shape's interned _Spec, the tensors' dtypes and
    alignment and the slot; such a key must determine what _Launcher.key derives from the arguments
    (else a kernel compiled for one specialization would be reused for another)."""
    from coatstate.formats.fp8 import FP8Format
    from coatstate.kernels import activation as K

    general = {}  # (launcher, its key) -> the key _Launcher.key gives
    real = K._Launcher.run

    def run(self, key, grid, args, constexprs):
        full = K._Launcher.key(args, constexprs)
        assert general.setdefault((self.kernel, key), full) == full, (key, full)
        return real(self, key, grid, args, constexprs)

    amax, scales = torch.zeros(64, dtype=torch.int32), torch.empty(64, dtype=torch.uint8)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(K._Launcher, "run", run)
        for fmt, dtype, (n, cols), slot in [
            (FP8Format.E4M3, torch.float32, (48, 16), 0),
            (FP8Format.E4M3, torch.float32, (48, 16), 1),
            (FP8Format.E4M3, torch.float32, (48, 16), 17),
            (FP8Format.E5M2, torch.bfloat16, (17, 17), 1),
            (FP8Format.E4M3, torch.bfloat16, (96, 3), 16),
            (FP8Format.E4M3, torch.bfloat16, (96, 3), 32),
        ]:
            for offset in (0, 1):  # (an unaligned pointer specializes differently)
                x = torch.randn(n + offset, dtype=dtype)[offset:]
                codes = K.pack_tensor_flat(x, n, fmt, amax, scales, slot)
                K.unpack_tensor_flat(codes, scales, slot, fmt, dtype)
                buf = K.pack_groups_flat(x, n, cols, 16, fmt)
                K.unpack_groups_flat(buf, n, cols, 16, fmt, dtype)
    assert len(general) > 12 and len(set(general.values())) > 12


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_unpacked_saves_keep_their_own_layout(backend):
    """Backward gets each save back in its own shape and stride, whichever way its region is
    unpacked: into the layout of the one save covering it, as a view of a flat tensor, or as a
    bfloat16 cast of a float32 norm input."""
    from coatstate.activations import Granularity

    torch.manual_seed(0)
    lin = nn.Linear(32, 48)
    x = torch.randn(6, 32)
    with compress_activations(min_numel=0, backend=backend) as ctx:
        h = lin(x)
        saves = [h * 1.0, (h * 1.0).t(), (h * 1.0).view(2, 3, 48).transpose(0, 1), (h * 1.0)[:, 8:40]]
        held = [ctx._pack(t) for t in saves]  # (each in a storage of its own)
        saves.append(h * 1.0)
        held.append(ctx._hold(saves[-1], Granularity.BF16, "norm"))
    for t, kept in zip(saves, held, strict=True):
        out = ctx._unpack(kept)
        assert out.shape == t.shape and out.stride() == t.stride(), (t.shape, t.stride(), out.stride())
        assert (out - t).abs().max() <= 0.07 * t.abs().max()
