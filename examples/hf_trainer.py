"""python examples/hf_trainer.py --steps 60

A transformers Trainer training a small GPT-2 (random init, byte-level: vocab 256) on the Python
standard library's source with coatstate.CompressedAdamW, passed through `optimizers=`. Trainer
saves its checkpoint (model.safetensors, optimizer.pt = torch.save(CompressedAdamW.state_dict()),
scheduler.pt, rng state) halfway; a second Trainer, with a fresh model and optimizer, resumes from
that checkpoint and trains to the end. The command above takes about 1.5 minutes on a 2-core
CPU. It prints Trainer's progress bars and logs, then the losses of the uninterrupted and the
resumed run after the checkpoint side by side and their largest difference. Checkpoints go to a
temporary directory, removed at the end; --output-dir DIR keeps them in DIR.

Expected difference: zero. The checkpoint holds the FP8 codes, scales and exponents themselves
and CompressedAdamW.load_state_dict copies them bit for bit (nothing is requantized), the model
weights and the data order are restored exactly and dropout is off. A requantized state would
instead differ by up to one FP8 step per moment (2**-3 relative for E4M3) and move the loss
measurably. Needs the `hf` extra: pip install -e '.[hf]'.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from train_gpt import stdlib_corpus  # the same corpus as the other examples (this folder is on sys.path)

import coatstate

try:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
except ImportError as e:  # an optional extra: say how to get it
    raise SystemExit(
        f"examples/hf_trainer.py needs transformers and accelerate: pip install -e '.[hf]' ({e})"
    ) from e


class ByteWindows(torch.utils.data.Dataset):
    """`count` fixed windows of `seq` bytes of the corpus (labels = inputs; GPT-2 shifts them)."""

    def __init__(self, data: torch.Tensor, seq: int, count: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data, self.seq = data, seq
        self.starts = torch.randint(0, data.numel() - seq, (count,), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.data[self.starts[i] : self.starts[i] + self.seq]
        return {"input_ids": window, "labels": window}


class RecordingTrainer(Trainer):
    """A Trainer that records each step's loss at full precision (its logs round to 4 digits)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step_losses: dict[int, float] = {}

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        loss = out[0] if return_outputs else out
        self.step_losses[self.state.global_step + 1] = loss.item()
        return out


def make_trainer(args: argparse.Namespace, dataset: ByteWindows) -> RecordingTrainer:
    torch.manual_seed(args.seed)
    config = GPT2Config(
        vocab_size=256,
        n_positions=args.seq,
        n_embd=args.dim,
        n_layer=args.layers,
        n_head=max(1, args.dim // 32),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,  # no dropout: resume must reproduce the losses
    )
    model = GPT2LMHeadModel(config)
    opt = coatstate.CompressedAdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.steps // 10),
        save_strategy="steps",
        save_steps=args.steps // 2,
        logging_steps=max(1, args.steps // 10),
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=args.quiet,
    )
    # scheduler None: Trainer builds its own (cosine with warmup) around our optimizer
    return RecordingTrainer(model=model, args=training_args, train_dataset=dataset, optimizers=(opt, None))


def run(args: argparse.Namespace) -> dict:
    """Train uninterrupted (saving a checkpoint halfway), then resume a fresh Trainer from it."""
    if args.steps < 2 or args.steps % 2:
        raise ValueError(
            f"--steps must be an even number >= 2 (the checkpoint is taken halfway); got {args.steps}"
        )
    dataset = ByteWindows(stdlib_corpus(), args.seq, args.steps * args.batch, args.seed)
    first = make_trainer(args, dataset)
    first.train()
    checkpoint = Path(args.output_dir) / f"checkpoint-{args.steps // 2}"
    if not (checkpoint / "optimizer.pt").exists():
        raise RuntimeError(f"Trainer wrote no optimizer.pt in {checkpoint}")
    second = make_trainer(args, dataset)
    second.train(resume_from_checkpoint=str(checkpoint))
    after = sorted(s for s in second.step_losses if s > args.steps // 2)
    diffs = [abs(first.step_losses[s] - second.step_losses[s]) for s in after]
    return {
        "checkpoint": str(checkpoint),
        "optimizer_pt_bytes": (checkpoint / "optimizer.pt").stat().st_size,
        "state_bytes": first.optimizer.optimizer.state_bytes()
        if hasattr(first.optimizer, "optimizer")
        else first.optimizer.state_bytes(),
        "params": sum(p.numel() for p in first.model.parameters()),
        "uninterrupted": {s: first.step_losses[s] for s in after},
        "resumed": {s: second.step_losses[s] for s in after},
        "max_abs_diff": max(diffs) if diffs else float("nan"),
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--steps", type=int, default=60, help="total steps (even); the checkpoint is taken halfway"
    )
    ap.add_argument(
        "--output-dir",
        help="where Trainer writes its checkpoints, kept (default: a temporary directory, removed)",
    )
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    return ap


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    keep = args.output_dir is not None
    if keep:
        result = run(args)
    else:  # nothing left behind in the working directory
        with tempfile.TemporaryDirectory(prefix="coatstate-hf-") as tmp:
            args.output_dir = tmp
            result = run(args)
    where = result["checkpoint"] if keep else "the halfway checkpoint (in a temporary directory, removed)"
    print(
        f"\n{result['params']} params; optimizer.pt of {where}: {result['optimizer_pt_bytes']} bytes "
        f"(state {result['state_bytes']} bytes, {result['state_bytes'] / result['params']:.3f} B/param)"
    )
    print(f"{'step':>6}{'uninterrupted':>15}{'resumed':>12}")
    for s, loss in result["uninterrupted"].items():
        print(f"{s:>6}{loss:>15.6f}{result['resumed'][s]:>12.6f}")
    print(
        f"largest |difference| after resuming: {result['max_abs_diff']:.3g} (expected 0: the FP8 states are "
        "restored bit for bit)"
    )
    return result


if __name__ == "__main__":
    main()
