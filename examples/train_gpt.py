"""python examples/train_gpt.py --optimizer compressed --compress-activations --steps 150

Trains a byte-level GPT on the Python standard library's own source (found on this machine, no
download) with CompressedAdamW (or torch AdamW) and, optionally, FP8 saved activations. The
command above takes about 20 s on a 2-core CPU (the README states the measured range). It prints a
progress bar, then a table: loss, optimizer-state bytes, activation bytes autograd saved (and what
compress_activations held of them), step time, optimizer-step time and tokens/s; --compare trains
again with the other optimizer and prints its row beside. --save/--resume take any fsspec URL (a
path, file://, memory://, s3://) through coatstate.save / coatstate.load; --save's destination is
checked before training.

On CUDA the loop runs as a GPU training loop usually does: forward and loss under bf16 autocast
(fp32 params, grads and optimizer states; --no-autocast for fp32 throughout) and TF32 for the
float32 matmuls that remain. On CPU autocast is off unless --autocast asks for it.

    python examples/train_gpt.py --device cuda --layers 12 --dim 768 --seq 1024 --batch 32 --compile
"""

# The functions here (stdlib_corpus, batches, train) are reused by benchmarks/checkpoint_io.py,
# benchmarks/experiments/ and examples/hf_trainer.py, so every script trains on the same bytes.

from __future__ import annotations

import argparse
import os
import posixpath
import sys
import sysconfig
import time
import warnings
from pathlib import Path

# torch's wheels do not install numpy, and `import torch` then warns that it could not load it;
# nothing here needs numpy, so that one warning is dropped (set before torch is first imported)
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import coatstate  # noqa: E402
from coatstate.activations import KEEP_ALL  # noqa: E402
from coatstate.models import GPT, ModelConfig  # noqa: E402


def stdlib_corpus(max_bytes: int = 8 * 2**20) -> torch.Tensor:
    """Bytes of the stdlib's .py files (site-packages skipped), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(
            f"the Python standard library's source is not at {root}; this corpus needs it"
        )
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def batches(data: torch.Tensor, batch: int, seq: int, seed: int):
    """Endless (inputs, targets) of `batch` random windows of `seq` bytes, the same for a seed."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        x = torch.stack([data[s : s + seq] for s in starts])
        y = torch.stack([data[s + 1 : s + seq + 1] for s in starts])
        yield x, y


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizer", choices=["adamw", "compressed"], default="compressed")
    ap.add_argument("--compress-activations", action="store_true")
    ap.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    ap.add_argument(
        "--compiled-activations",
        action="store_true",
        help="compile each block with coatstate.CompiledActivations: FP8 saves inside the graphs",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--autocast",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 autocast for forward and loss (default: on with CUDA, off on CPU)",
    )
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", help="URL to save optimizer + model to at the end")
    ap.add_argument("--resume", help="URL of a checkpoint written by --save")
    ap.add_argument(
        "--compare",
        action="store_true",
        help="then train again with the other optimizer (torch AdamW or CompressedAdamW); print both rows",
    )
    return ap


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer that `args` describe, seeded by args.seed."""
    torch.manual_seed(args.seed)
    cfg = ModelConfig.byte_level(args.layers, args.dim, args.seq)
    model = GPT(cfg).to(args.device)
    if args.optimizer == "compressed":
        opt = coatstate.CompressedAdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    return model, opt


def train(args: argparse.Namespace, progress: bool = True) -> dict:
    """Train as `args` says. Returns losses, timings and byte counts, plus "model" and "opt"."""
    device = torch.device(args.device)
    use_autocast = autocast_enabled(args)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for the fp32 matmuls autocast leaves
    model, opt = build(args)
    if args.resume:
        coatstate.load(opt, args.resume, model=model)
    fp8_graphs = None
    if getattr(args, "compiled_activations", False):
        fp8_graphs = coatstate.CompiledActivations()
        for block in model.blocks:
            block.compile(options=fp8_graphs.options)
    elif getattr(args, "compile", False):
        for block in model.blocks:
            block.compile()
    stream = batches(stdlib_corpus(), args.batch, args.seq, args.seed)
    losses, times, opt_times = [], [], []
    act_original = act_held = 0
    quiet = not progress or (not sys.stderr.isatty() and "CI" in os.environ)
    label = args.optimizer + (" + FP8 activations" if args.compress_activations or fp8_graphs else "")
    label += ", bf16 autocast" if use_autocast else ""
    bar = tqdm(range(args.steps), desc=label, disable=quiet)
    for step in bar:
        x, y = (t.to(device) for t in next(stream))
        t0 = time.perf_counter()
        # without compression, the first step counts what autograd saves (it is not timed below)
        policy = {} if args.compress_activations else KEEP_ALL if step == 0 else None
        # forward and loss under autocast; backward and the optimizer step outside it, as usual
        amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast)
        if policy is not None:
            with coatstate.compress_activations(**policy) as ctx, amp:
                loss = model(x, y)
            act_original = ctx.stats.activation_bytes_original
            act_held = ctx.stats.activation_bytes_held
        else:
            with amp:
                loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()  # for the step time only (loss.item() below waits anyway)
        opt_times.append(time.perf_counter() - t1)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if fp8_graphs is not None and step == 0:  # counted per compiled graph (one serves all blocks)
            blocks_per_graph = len(model.blocks) / max(1, fp8_graphs.graphs)
            act_original = int(fp8_graphs.stats.activation_bytes_original * blocks_per_graph)
            act_held = int(fp8_graphs.stats.activation_bytes_held * blocks_per_graph)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    if args.save:
        coatstate.save(opt, args.save, model=model)
    timed = times[1:] or times  # the first step allocates state (and may count activations)
    tail = losses[-10:]
    step_s = sorted(timed)[len(timed) // 2] if timed else float("nan")
    opt_timed = opt_times[1:] or opt_times
    opt_s = sorted(opt_timed)[len(opt_timed) // 2]
    return dict(
        optimizer=args.optimizer,
        compress_activations=args.compress_activations or fp8_graphs is not None,
        autocast=use_autocast,
        params=sum(p.numel() for p in model.parameters()),
        final_loss=sum(tail) / max(1, len(tail)),
        state_bytes=coatstate.optim.optimizer_state_bytes(opt),
        activation_bytes_saved=act_original,
        activation_bytes_held=act_held,
        step_ms=1e3 * step_s,
        opt_step_ms=1e3 * opt_s,
        tokens_per_s=args.batch * args.seq / step_s,
        losses=losses,
        model=model,
        opt=opt,
    )


def autocast_enabled(args: argparse.Namespace) -> bool:
    """--autocast / --no-autocast, else on for CUDA only (CPU bf16 matmuls are slow on most CPUs)."""
    choice = getattr(args, "autocast", None)
    return torch.device(args.device).type == "cuda" if choice is None else choice


def print_table(rows: list[dict]) -> None:
    """One line per run: the numbers train() returns (step time: the median step)."""
    mb = 1e6
    print(
        f"\n{'optimizer':<11}{'act. FP8':<9}{'params':>11}{'loss (last 10)':>15}{'state MB':>10}"
        f"{'B/param':>8}{'act. saved MB':>14}{'act. held MB':>13}{'step ms':>9}{'opt. ms':>9}{'tokens/s':>10}"
    )
    for r in rows:
        print(
            f"{r['optimizer']:<11}{str(r['compress_activations']):<9}{r['params']:>11,}{r['final_loss']:>15.4f}"
            f"{r['state_bytes'] / mb:>10.3f}{r['state_bytes'] / r['params']:>8.3f}"
            f"{r['activation_bytes_saved'] / mb:>14.2f}{r['activation_bytes_held'] / mb:>13.2f}"
            f"{r['step_ms']:>9.1f}{r['opt_step_ms']:>9.1f}{r['tokens_per_s']:>10,.0f}"
        )


def check_save_destination(url: str) -> None:
    """Fail before training, not after it: `url` must not be a folder, and its folder must exist
    (or be creatable) and take a file there (a probe is written and removed)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    if fs.isdir(path):
        raise SystemExit(
            f"--save {url}: is a directory; give a file name, e.g. {url.rstrip('/')}/step.safetensors"
        )
    probe = f"{path}.{os.getpid()}.probe"
    try:
        if posixpath.dirname(path):
            fs.makedirs(posixpath.dirname(path), exist_ok=True)
        with fs.open(probe, "wb") as f:
            f.write(b"")
        fs.rm(probe)
    except OSError as e:
        raise SystemExit(f"--save {url}: cannot write a file there ({type(e).__name__}: {e})") from None


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    if args.steps < 1:
        raise SystemExit(f"--steps must be at least 1; got {args.steps}")
    if args.save:
        check_save_destination(args.save)
    result = train(args)
    rows = [result]
    if args.compare:  # the same run with the other optimizer: memory and speed side by side
        other = "adamw" if args.optimizer == "compressed" else "compressed"
        rows.append(
            train(argparse.Namespace(**{**vars(args), "optimizer": other, "save": None, "resume": None}))
        )
    print_table(rows)
    precision = "bf16 autocast" if result["autocast"] else "fp32"
    print(f"({args.device}, {precision}; {args.batch} x {args.seq} tokens per step)")
    if args.save:
        print(f"saved to {args.save}")
    return result


if __name__ == "__main__":
    main()
