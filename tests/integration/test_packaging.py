"""Issue #31, packaging: what `pip install coatstate` gives a user.

The wheel holds every package (pyproject lists them; formats/ and kernels/ install as
coatstate.formats / coatstate.kernels, never top-level), one version number is read everywhere,
and the CPU path needs neither numpy (torch's wheels do not bring it) nor triton nor zstandard.
.ci/wheel_smoke.py checks the same on a built and installed wheel; these run in-process.
"""

from __future__ import annotations

import gc
import re
import sys
from pathlib import Path

import pytest
import torch
from coatstate.formats import schema

import coatstate
from coatstate.cli import main as cli_main

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
PROJECT = PYPROJECT["project"]


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].strip().lower() for r in requirements}


# -- what the wheel holds ------------------------------------------------------------------------
def test_pyproject_lists_every_package_of_the_tree():
    """The old list named coatstate, coatstate.formats and coatstate.kernels only: the wheel then
    lacked coatstate.optim, .activations, .nn, .checkpoint, .planner and .cli."""
    in_tree = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "coatstate").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    in_tree |= {"coatstate.formats", "coatstate.kernels"}
    listed = set(SETUPTOOLS["packages"])
    assert listed == in_tree, (
        f"missing from pyproject: {in_tree - listed}; listed, not in the tree: {listed - in_tree}"
    )
    assert {"formats", "kernels"}.isdisjoint(listed)  # a PyPI `kernels` exists: never top-level
    assert SETUPTOOLS["package-dir"] == {
        "coatstate": "coatstate",
        "coatstate.formats": "formats",
        "coatstate.kernels": "kernels",
    }
    assert "py.typed" in SETUPTOOLS["package-data"]["coatstate"]
    assert (ROOT / "coatstate" / "py.typed").is_file()


def test_one_version_in_pyproject_the_package_the_changelog_and_headers(tmp_path):
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "coatstate.__version__"}
    top = re.search(r"^## (\d+\.\d+\.\d+)", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert top and coatstate.__version__ == top.group(1), (coatstate.__version__, top and top.group(1))
    opt = _stepped_optimizer()
    coatstate.save(opt, str(tmp_path / "v.safetensors"))
    assert coatstate.read(str(tmp_path / "v.safetensors")).header["library_version"] == coatstate.__version__


# -- dependencies as users get them -------------------------------------------------------------
def test_runtime_dependencies_hold_nothing_the_cpu_path_does_not_need():
    runtime = _requirement_names(PROJECT["dependencies"])
    assert {"torch", "safetensors", "fsspec"} <= runtime
    assert runtime.isdisjoint({"numpy", "triton", "zstandard"}), runtime
    extras = {name: _requirement_names(reqs) for name, reqs in PROJECT["optional-dependencies"].items()}
    assert "triton" in extras["gpu"] and "zstandard" in extras["zstd"]
    # the test suite: Triton's interpreter (numpy), zstd files, a local S3 server for s3:// tests
    assert {"pytest", "hypothesis", "numpy", "triton", "zstandard", "moto", "s3fs"} <= extras["test"]


def _stepped_optimizer() -> coatstate.CompressedAdamW:
    model = torch.nn.Linear(128, 64)
    opt = coatstate.CompressedAdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 128)).square().sum().backward()
    opt.step()
    return opt


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def test_save_load_inspect_convert_without_numpy(tmp_path, monkeypatch, capsys):
    """torch without numpy raises "Numpy is not available" from Tensor.numpy(): schema.tensor_bytes
    called it, so coatstate.save, load, `inspect --verify` and `convert` failed on a plain install."""

    def no_numpy(self, *args, **kwargs):
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    path = str(tmp_path / "ck.safetensors")
    opt = _stepped_optimizer()
    coatstate.save(opt, path)
    fresh = coatstate.CompressedAdamW(
        [torch.nn.Parameter(p.detach().clone()) for p in opt.param_groups[0]["params"]]
    )
    coatstate.load(fresh, path)
    for a, b in zip(opt.state.values(), fresh.state.values(), strict=True):
        assert {k: _raw(v) for k, v in a.items()} == {k: _raw(v) for k, v in b.items()}
    assert cli_main(["inspect", path, "--verify"]) == 0
    assert "checksums: all verified" in capsys.readouterr().out
    back = str(tmp_path / "back.pt")
    assert cli_main(["convert", path, back, "--to", "adamw"]) == 0
    assert cli_main(["convert", back, str(tmp_path / "again.safetensors")]) == 0


def test_tensor_bytes_is_a_writable_view_that_keeps_its_tensor():
    t = torch.arange(6, dtype=torch.float32)
    view = schema.tensor_bytes(t[::2])  # not contiguous: a copy, which the view must keep alive
    del t
    gc.collect()
    assert bytes(view) == _raw(torch.tensor([0.0, 2.0, 4.0]))
    out = torch.zeros(2, 3, dtype=torch.float8_e4m3fn)
    dest = schema.tensor_bytes(out)
    dest[:] = bytes(range(6))  # readers fill tensors through this view
    assert out.view(torch.uint8).flatten().tolist() == list(range(6))
    assert schema.tensor_bytes(torch.empty(0, 4)).nbytes == 0


def test_zstd_without_zstandard_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(ImportError, match=re.escape("pip install 'coatstate[zstd]'")):
        coatstate.save(_stepped_optimizer(), str(tmp_path / "z.safetensors"), compress="zstd")
