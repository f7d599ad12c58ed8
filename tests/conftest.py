import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU, Triton kernels run under Triton's CPU interpreter (small shapes only). It
    # must be set before any kernel module is imported, hence here.
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER") and (n := os.environ.get("PYTEST_XDIST_WORKER_COUNT")):
    # the workers share the cores: torch's threads in each would otherwise oversubscribe them. The
    # environment carries the share to the scripts and ranks the tests start as subprocesses: with
    # a thread per core each, their OpenMP threads spun against the other worker's
    share = max(1, (os.cpu_count() or 1) // int(n))
    torch.set_num_threads(share)
    os.environ.setdefault("OMP_NUM_THREADS", str(share))


def _one_tree() -> None:
    """coatstate, coatstate.formats and coatstate.kernels must come from one source tree. An
    editable install maps formats/ and kernels/ to the tree it was made from, so a second
    checkout (a git worktree) on PYTHONPATH would otherwise test its own coatstate against the
    first tree's kernels, silently."""
    from pathlib import Path

    import coatstate.formats
    import coatstate.kernels

    import coatstate

    package = Path(coatstate.__file__).resolve().parent
    for module in (coatstate.formats, coatstate.kernels):
        path = Path(module.__file__).resolve()
        where, root = path.parents[1], package.parent
        if where != root and package not in path.parents:  # (the tree's layout, or a wheel's)
            raise RuntimeError(
                f"{module.__name__} is imported from {where}, coatstate from {root}: an editable "
                "install of another checkout maps it there. Install this checkout "
                "(pip install -e .) or run from the tree the install points to."
            )


_one_tree()

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict:
    """The environment for a Python child a test starts: it imports tests.* and the benchmarks'
    and examples' modules as pytest does (pyproject's pythonpath), plus `extra`."""
    paths = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), **extra}
