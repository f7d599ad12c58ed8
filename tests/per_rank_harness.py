"""What tests/test_hostile_per_rank.py builds its cases with: good per-rank checkpoints, their
root and rank files edited as a buggy or malicious writer would (checksums recomputed), and the
judge that loads, reads and inspects each case.

The judge's rule: a case is refused with one CheckpointError naming the root (the CLI: exit 1,
one line on stderr), the target model and optimizer unchanged, nothing outside the checkpoint's
directory opened; or it loads bit-identical to the good checkpoint ('same').
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import struct
import sys
from collections import Counter

import torch
from coatstate.formats.schema import CheckpointError
from test_hostile_input import _bits, _deadline, _model, _train, _with_header

from coatstate import checkpoint as ck
from coatstate.checkpoint import rank_files, rank_read
from coatstate.cli import main as cli
from coatstate.optim import CompressedAdamW

_OPENED: list[str] | None = None
"""While a list: every path the process opens (an audit hook; hooks cannot be removed)."""


def _audit(event: str, args) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


def small_model() -> torch.nn.Module:
    """test_hostile_input's model (FP8 moments for the weights, float32 for the biases), seed 7."""
    return _model(7)


small_train = _train
"""test_hostile_input's training loop: (model, opt, steps, seed)."""


class Target:
    """A model and optimizer with state of their own, to load into and compare afterwards."""

    def __init__(self, make):
        self.model, self.opt = make()
        self.before = self.snapshot()

    def snapshot(self):
        return _bits(self.model.state_dict()), _bits(self.opt.state_dict())


def small_target():
    model = small_model()
    opt = CompressedAdamW(model.parameters(), lr=1e-2)
    small_train(model, opt, 1, seed=7)
    return model, opt


class Saved:
    """A good per-rank checkpoint: its directory, root bytes, rank files and what it loads as."""

    def __init__(self, directory, make_target):
        self.dir, self.make_target = str(directory), make_target
        self.root = pathlib.Path(self.path).read_bytes()
        self.files = [f["file"] for f in ck.read_header(self.path)["per_rank"]["files"]]
        self.data = {n: pathlib.Path(self.dir, n).read_bytes() for n in self.files}
        good = Target(make_target)
        ck.load(good.opt, self.path, model=good.model)
        self.loaded = good.snapshot()

    @property
    def path(self) -> str:
        return os.path.join(self.dir, "ckpt.safetensors")


def two_rank_worker(rank, world_size, port, out):
    import torch.distributed as dist
    from test_distributed import _fsdp, _init, _optimizer, _train

    mesh = _init(rank, world_size, port)
    model = _fsdp(mesh)
    opt = _optimizer(model)
    _train(model, opt, 0, 1)
    ck.save(opt, os.path.join(out, "ckpt.safetensors"), model=model, distributed="per_rank")
    dist.barrier()
    dist.destroy_process_group()


def big_target():
    from test_distributed import _model, _optimizer, _train

    model = _model()
    opt = _optimizer(model)
    _train(model, opt, 5, 1)
    return model, opt


def case_dir(tmp_path, saved: Saved, name: str, root: bytes | None = None, files: dict | None = None):
    """A directory holding the good checkpoint with `root` and `files` ({name: bytes}) replaced."""
    d = tmp_path / "".join(c if c.isalnum() else "_" for c in name)
    while d.exists():  # names that differ only in punctuation
        d = d.with_name(d.name + "_")
    d.mkdir()
    (d / "ckpt.safetensors").write_bytes(saved.root if root is None else root)
    for n, data in {**saved.data, **(files or {})}.items():
        if data is not None:
            (d / n).write_bytes(data)
    return d


def _cli_line(argv, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = cli(argv)
    err = capsys.readouterr().err
    if code:
        assert err.count("\n") == 1 and argv[1] in err, (argv, err)
        assert "Traceback" not in err and "unexpected error" not in err, (argv, err)
    return code, err


def _judge(saved: Saved, target: Target, d, capsys, strict_inspect: bool, outside=(), full=True) -> str:
    """'refused' or 'same' for the checkpoint in directory `d`, after checking load, read and the
    CLI (not `full`: load, read and inspect --verify); `outside`: paths never to be opened."""
    global _OPENED
    url = str(d / "ckpt.safetensors")
    _OPENED = []
    try:
        with _deadline(20, url):
            outcome = _load(saved, target, url)
            try:
                ck.read(url)
                read_ok = True
            except CheckpointError as e:
                assert url in str(e), str(e)
                read_ok = False
            assert read_ok or outcome == "refused", f"{url}: loads but read() refuses it"
            codes = {"verify": _cli_line(["inspect", url, "--verify"], capsys)[0]}
            if full:
                _unverified_and_partial_reads(url)
                codes["inspect"] = _cli_line(["inspect", url], capsys)[0]
                codes["convert"] = _cli_line(["convert", url, str(d / "out.safetensors")], capsys)[0]
    finally:
        opened, _OPENED = _OPENED, None
    leaks = [p for p in opened for o in outside if os.path.realpath(p).startswith(os.path.realpath(o))]
    assert not leaks, f"{url}: opened {leaks[:3]} outside the checkpoint's directory"
    if outcome == "refused":
        assert codes["verify"] == codes.get("convert", 1) == 1, (url, codes)
        assert codes.get("inspect", 1) == 1 or not strict_inspect, (url, codes)
    else:
        assert set(codes.values()) == {0}, (url, codes)
    return outcome


def _unverified_and_partial_reads(url: str) -> None:
    """read(verify=False), and the second half of the rows of the model's and the first
    parameter's tensors as a rank of a sharded load reads them (rank_read's range reads): a
    CheckpointError naming the root, or data."""
    try:
        ck.read(url, verify=False)
    except CheckpointError as e:
        assert url in str(e), str(e)
    try:
        header = ck.read_header(url)
    except CheckpointError as e:
        assert url in str(e), str(e)
        return
    for key, info in header["tensors"].items():  # a reader each: no file checked by another key
        if not key.startswith(("model/", "state/0/")):
            continue
        rows = rank_files.num_rows(info["shape"])
        try:
            rank_read._Reader(url, header, verify=True).rows(key, rows // 2, rows)
        except CheckpointError as e:
            assert url in str(e), str(e)


def _load(saved: Saved, target: Target, url: str) -> str:
    try:
        ck.load(target.opt, url, model=target.model)
    except CheckpointError as e:
        assert url in str(e), f"the error does not name the root: {e}"
        assert target.snapshot() == target.before, f"a failed load of {url} changed the target"
        return "refused"
    assert target.snapshot() == saved.loaded, f"{url} loaded other bits than the good checkpoint"
    return "same"


def run_cases(
    cases, saved: Saved, tmp_path, capsys, wrong: list, strict_inspect=True, allow_same=(), full=True
):
    """Judge every (name, root bytes, files, outside) case, adding what went wrong to `wrong`;
    a fresh target after each load."""
    target, outcomes = Target(saved.make_target), Counter()
    for name, root, files, outside in cases:
        d = case_dir(tmp_path, saved, name, root, files)
        if callable(outside):  # a case that sets up special files in its directory
            outside = outside(d)
        try:
            outcome = _judge(saved, target, d, capsys, strict_inspect, outside, full)
        except Exception as e:  # noqa: BLE001 - every case is run; all failures reported at once
            wrong.append(f"{name}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
            target = Target(saved.make_target)
            continue
        outcomes[outcome] += 1
        if outcome == "same":
            target = Target(saved.make_target)
            if name not in allow_same:
                wrong.append(f"{name}: loaded although hostile")
    return outcomes


def index_edit(fn):
    return lambda h: fn(h["per_rank"])


def file0_edit(**kw):
    return index_edit(lambda p: p["files"][0].update(**kw))


def split_edit(key: str, pieces) -> object:
    """Tensor `key` cut as `pieces` (a new split of its own)."""

    def edit(h):
        h["per_rank"]["splits"].append(pieces)
        h["per_rank"]["tensor_splits"][key] = len(h["per_rank"]["splits"]) - 1

    return edit


def deep(depth: int):
    return "[" * depth + "]" * depth


def rank_edit(saved: Saved, i: int = 0, manifest=None, manifest_text=None, outer=None, raw=None):
    """Rank file `i` with its manifest or safetensors header edited, and the root's size and
    manifest sha256 of it recomputed (a writer that got its file wrong, consistently)."""
    data = saved.data[saved.files[i]]
    n = struct.unpack("<Q", data[:8])[0]
    head = json.loads(data[8 : 8 + n])
    text = head["__metadata__"][rank_files.MANIFEST_KEY]
    if manifest is not None:
        m = json.loads(text)
        manifest(m)
        text = json.dumps(m, separators=(",", ":"))
    if manifest_text is not None:
        text = manifest_text(text)
    head["__metadata__"][rank_files.MANIFEST_KEY] = text
    if outer is not None:
        outer(head)
    st = json.dumps(head, separators=(",", ":")).encode()  # ASCII: a lone surrogate stays escaped
    st += b" " * (-len(st) % 8)
    new = struct.pack("<Q", len(st)) + st + data[8 + n :]
    if raw is not None:
        new = raw(new)
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()

    def edit(h):
        h["per_rank"]["files"][i].update(bytes=len(new), manifest_sha256=digest)

    return _with_header(saved.root, edit=edit), {saved.files[i]: new}


def flips(data: bytes, ranges, count: int, seed: int):
    """`count` copies of `data` with one bit flipped, spread over the byte `ranges`."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for j in range(count):
        lo, hi = ranges[j % len(ranges)]
        pos, bit = int(torch.randint(lo, hi, (1,), generator=g)), int(torch.randint(0, 8, (1,), generator=g))
        flipped = bytearray(data)
        flipped[pos] ^= 1 << bit
        out.append((pos, bytes(flipped)))
    return out
