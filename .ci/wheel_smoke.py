"""CI: the installed wheel as a user gets it. .ci/run calls it as `cd / && python -I wheel_smoke.py`.

It checks that only the declared runtime dependencies are there (no numpy, triton or zstandard),
that every module imports from site-packages (kernel modules may need triton), that a CPU
CompressedAdamW step under compress_activations runs, that save/load through a real file gives
the state back bit for bit with this version in its header, that the `coatstate` command answers
--help, --version and inspect, that compress="zstd" without zstandard names the extra, and
that the wheel carries the CPU step's C++ source and, where a compiler exists, builds it.
Every check runs; the failures are listed at the end and the exit status is 1 if there is one.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import pkgutil
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

# torch's wheels do not bring numpy, and `import torch` then warns; that is what users see
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

NOT_DECLARED = ("numpy", "triton", "zstandard")
"""Packages the CPU path must not need: the smoke runs without them."""


def check_environment() -> None:
    present = [name for name in NOT_DECLARED if importlib.util.find_spec(name) is not None]
    assert not present, f"{present} installed: this smoke must run with the declared dependencies only"


def check_installed_from_site_packages() -> None:
    import coatstate

    where = Path(coatstate.__file__).resolve()
    assert "site-packages" in where.parts, f"coatstate imported from {where}, not the installed wheel"
    tops = {Path(str(f)).parts[0] for f in importlib.metadata.files("coatstate")}
    extra = tops - {"coatstate", f"coatstate-{coatstate.__version__}.dist-info", ".."}  # "..": bin/
    assert not extra, f"the wheel installs top-level {sorted(extra)} (only coatstate/ is allowed)"
    for name in ("formats", "kernels"):
        spec = importlib.util.find_spec(name)
        assert spec is None, f"a top-level {name!r} is importable from {spec.origin}"


def check_version() -> None:
    import coatstate

    installed = importlib.metadata.version("coatstate")
    assert coatstate.__version__ == installed, f"__version__ {coatstate.__version__} vs metadata {installed}"


def check_every_module_imports() -> None:
    import coatstate

    names = [m.name for m in pkgutil.walk_packages(coatstate.__path__, "coatstate.")]
    for sub in ("optim", "activations", "nn", "checkpoint", "planner", "cli", "formats", "kernels"):
        assert f"coatstate.{sub}" in names, f"coatstate.{sub} is missing from the wheel"
    for name in names:
        if name == "coatstate.__main__":
            continue  # runs the CLI
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            # the Triton kernels need triton (the `gpu` extra, or torch's CUDA wheels)
            if not (e.name == "triton" and name.startswith("coatstate.kernels.")):
                raise


def _train_step(seed: int = 0):
    import torch

    import coatstate

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = coatstate.CompressedAdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    with coatstate.compress_activations(min_numel=0) as ctx:
        loss = model(torch.randn(32, 256)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    assert ctx.stats.packed >= 1, f"compress_activations packed nothing: {ctx.stats}"
    assert torch.isfinite(loss), loss
    return model, opt


def _bytes(t):
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def check_step_save_load(tmp: Path) -> None:
    import torch

    import coatstate

    model, opt = _train_step()
    path = tmp / "step1.safetensors"
    coatstate.save(opt, str(path), model=model)
    assert path.stat().st_size > 0
    header = coatstate.read(str(path)).header
    assert header["library_version"] == coatstate.__version__, header["library_version"]
    fresh = coatstate.CompressedAdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    coatstate.load(fresh, str(path))
    want, got = opt.state_dict()["state"], fresh.state_dict()["state"]
    assert want.keys() == got.keys(), (sorted(want), sorted(got))
    for pid, state in want.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(_bytes(value), _bytes(got[pid][key])), f"state {pid}/{key} differs"


def check_zstd_names_the_extra(tmp: Path) -> None:
    import coatstate

    _, opt = _train_step()
    try:
        coatstate.save(opt, str(tmp / "z.safetensors"), compress="zstd")
    except ImportError as e:
        assert "coatstate[zstd]" in str(e), f"the error does not name the extra: {e}"
    else:
        raise AssertionError("compress='zstd' without zstandard installed did not raise")


def _cli(*args: str) -> str:
    exe = Path(sys.executable).parent / "coatstate"
    done = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"coatstate {' '.join(args)}: rc {done.returncode}\n{done.stderr[-2000:]}"
    return done.stdout


def check_cli(tmp: Path) -> None:
    import coatstate

    assert "inspect" in _cli("--help")
    model, opt = _train_step()
    path = tmp / "cli.safetensors"
    coatstate.save(opt, str(path), model=model)
    out = _cli("inspect", str(path), "--verify")
    assert "CompressedAdamW" in out and "checksums: all verified" in out, out


def check_cpu_step_builds() -> None:
    """The wheel carries the C++ step's source: where a compiler exists, the step builds."""
    from coatstate.kernels import cpu_step

    missing = [p.name for p in (cpu_step.SOURCE, *cpu_step.HEADERS) if not p.exists()]
    assert not missing, f"the wheel lacks {missing}: CompressedAdamW's CPU step falls back to the twin"
    if cpu_step.compiler() is not None:
        assert cpu_step.library() is not None, "the CPU step did not build (see the log line above)"


def check_cli_version() -> None:
    import coatstate

    out = _cli("--version")
    assert coatstate.__version__ in out, f"coatstate --version printed {out!r}"


def main() -> int:
    failures = []
    with tempfile.TemporaryDirectory() as d:
        checks = [
            (check_environment, ()),
            (check_installed_from_site_packages, ()),
            (check_version, ()),
            (check_every_module_imports, ()),
            (check_step_save_load, (Path(d),)),
            (check_zstd_names_the_extra, (Path(d),)),
            (check_cli, (Path(d),)),
            (check_cli_version, ()),
            (check_cpu_step_builds, ()),
        ]
        for check, args in checks:
            try:
                check(*args)
            except Exception:  # noqa: BLE001 - every check runs; each failure is listed below
                failures.append(check.__name__)
                print(f"FAIL {check.__name__}\n{traceback.format_exc()}", flush=True)
            else:
                print(f"ok   {check.__name__}", flush=True)
    if failures:
        print(f"wheel smoke: {len(failures)} of {len(checks)} checks failed: {failures}")
        return 1
    print(f"wheel smoke: all {len(checks)} checks passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
