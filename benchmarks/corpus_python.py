"""A byte-level corpus found on any machine without network: the .py sources of this Python's
standard library and installed packages (parity_gpu.py's and optimizers_cpu_train.py's data).

load_corpus() reads every .py file under the chosen roots (sysconfig's "stdlib", "purelib", and
"torch") but generated giants, in name order, into one uint8 stream cached under cache_dir by the
listing. A file validates when sha1(its root-relative name) % 100 < val_pct: the same split on
every machine. window_batch() draws a step's rows as random windows of the joined training files,
their offsets from (seed, step) alone, so any step's batch is reproducible without replaying the
run (one concatenated stream cut into batches spread AdamW's seeds too far to resolve anything).
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path

import torch

SEP = 0
"""Byte after each file: a document boundary the model can see (.py sources hold no NUL)."""
MAX_FILE = 2 * 2**20
OWN_PACKAGE, EDITABLE_FINDER = "coatstate", "__editable__"
"""This project's own install (a regular install's package, pip -e's finder named after the
version) is left out: a corpus that changed with our version would refuse every earlier run."""


def corpus_roots(names: str) -> list[tuple[str, Path]]:
    """(name, directory) of each comma-separated root that exists, duplicates dropped."""
    paths, roots = sysconfig.get_paths(), []
    for name in names.split(","):
        path = Path(torch.__file__).parent.parent if name == "torch" else Path(paths[name])
        if path.is_dir() and all(path.resolve() != p.resolve() for _, p in roots):
            roots.append((name, path))
    return roots


def list_files(roots: list[tuple[str, Path]], max_mb: float = 0) -> tuple[list, int]:
    """([(name, path, size, mtime)] sorted by name, files skipped as too large). Nothing is listed
    twice: a root inside another is left to itself, and the stdlib's site-packages to purelib."""
    found, seen, large = [], set(), 0
    for name, root in roots:
        inner = {p.resolve() for n, p in roots if n != name}
        skip = {"__pycache__"} | ({"site-packages", "dist-packages"} if name == "stdlib" else set())
        for d, dirs, files in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x not in skip and Path(d, x).resolve() not in inner)
            if name == "purelib" and Path(d) == root:
                dirs[:] = [x for x in dirs if x != OWN_PACKAGE]
            for f in files:
                path = Path(d, f)
                if not f.endswith(".py") or path.is_symlink() or f.startswith(EDITABLE_FINDER):
                    continue
                try:
                    st, real = path.stat(), path.resolve()
                except OSError:
                    continue
                if st.st_size > MAX_FILE or real in seen:
                    large += st.st_size > MAX_FILE
                    continue
                seen.add(real)
                found.append((f"{name}/{path.relative_to(root)}", path, st.st_size, st.st_mtime_ns))
    found.sort()
    if max_mb:  # the first files in name order up to the cap (a small corpus for smoke runs)
        total, cap = 0, max_mb * 2**20
        for i, item in enumerate(found):
            if total >= cap:
                found = found[:i]
                break
            total += item[2]
    return found, large


def _build(files: list, bin_path: Path, meta_path: Path) -> None:
    used, unreadable = [], 0
    with open(f"{bin_path}.tmp", "wb") as out:
        for rel, path, _, _ in files:
            try:
                data = path.read_bytes()
            except OSError:
                unreadable += 1
                continue
            out.write(data)
            used.append((rel, len(data)))
    os.replace(f"{bin_path}.tmp", bin_path)  # the .bin first: the .json says the cache is whole
    Path(f"{meta_path}.tmp").write_text(json.dumps({"files": used, "unreadable": unreadable}))
    os.replace(f"{meta_path}.tmp", meta_path)


def load_corpus(roots: str, cache_dir: str, val_pct: int = 1, max_mb: float = 0) -> dict:
    """{"stream": uint8 tensor of all files in name order, "offsets": file i is
    stream[offsets[i]:offsets[i+1]], "is_val": per file, "stats": sizes, counts, sha256}."""
    where = corpus_roots(roots)
    files, large = list_files(where, max_mb)
    key = hashlib.sha256(repr([(r, s, m) for r, _, s, m in files]).encode()).hexdigest()[:20]
    cache = Path(cache_dir)
    meta_path, bin_path = cache / f"{key}.json", cache / f"{key}.bin"
    if not meta_path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        _build(files, bin_path, meta_path)
    meta = json.loads(meta_path.read_text())
    names, sizes = [r for r, _ in meta["files"]], [s for _, s in meta["files"]]
    total = sum(sizes)
    stream = torch.from_file(str(bin_path), shared=False, size=total, dtype=torch.uint8)
    is_val = [int.from_bytes(hashlib.sha1(r.encode()).digest()[:8], "big") % 100 < val_pct for r in names]
    val_bytes = sum(s for s, v in zip(sizes, is_val, strict=True) if v)
    listing = "".join(f"{r}\t{s}\n" for r, s in sorted(meta["files"]))
    stats = {
        "roots": {n: str(p) for n, p in where},
        "total_bytes": total,
        "files": len(names),
        "train_files": len(names) - sum(is_val),
        "train_bytes": total - val_bytes,
        "val_files": sum(is_val),
        "val_bytes": val_bytes,
        "skipped_large_files": large,
        "unreadable_files": meta["unreadable"],
        "sha256": hashlib.sha256(listing.encode()).hexdigest(),
        "sha256_of": "sorted 'root/relative/path<TAB>bytes<LF>' lines of the files used",
    }
    offsets = torch.tensor([0] + sizes).cumsum(0).tolist()
    return {"stream": stream, "offsets": offsets, "is_val": is_val, "stats": stats}


def joined_files(corpus: dict, validation: bool) -> torch.Tensor:
    """The training (or validation) files in name order, a byte SEP after each."""
    off, sep = corpus["offsets"], torch.tensor([SEP], dtype=torch.uint8)
    files = [i for i, v in enumerate(corpus["is_val"]) if v == validation]
    if not files:
        raise ValueError("the corpus has no " + ("validation" if validation else "training") + " files")
    return torch.cat([t for i in files for t in (corpus["stream"][off[i] : off[i + 1]], sep)])


def window_offsets(n_tokens: int, seed: int, step: int, rows: int, seq: int) -> torch.Tensor:
    """The start of each of a step's `rows` windows of seq + 1 tokens, uniform over the stream.
    Drawn from a generator keyed by (seed, step) only: a resumed run draws what an uncut one did."""
    g = torch.Generator().manual_seed(1000003 * seed + step)
    return torch.randint(0, n_tokens - seq, (rows,), generator=g)


def window_batch(train: torch.Tensor, seed: int, step: int, rows: int, seq: int) -> torch.Tensor:
    """(rows, seq + 1) int64 tokens of step `step`: inputs are [:, :-1], targets [:, 1:]."""
    if len(train) <= seq:
        raise ValueError(f"the training files hold {len(train)} tokens, fewer than one window of {seq + 1}")
    starts = window_offsets(len(train), seed, step, rows, seq).to(train.device, non_blocking=True)
    return train[starts[:, None] + torch.arange(seq + 1, device=train.device)].long()


def validation_tokens(corpus: dict, n: int, batch_tokens: int) -> torch.Tensor:
    """The first n validation tokens (fewer if the files hold fewer), cut to whole batches plus
    the one token the last target needs."""
    val = joined_files(corpus, validation=True)[: n + 1]
    if len(val) <= batch_tokens:
        raise SystemExit(
            f"the validation files hold {len(val)} tokens, less than one batch of {batch_tokens}"
        )
    return val[: (len(val) - 1) // batch_tokens * batch_tokens + 1]
