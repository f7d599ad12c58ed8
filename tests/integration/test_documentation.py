"""Issue #31: the docs work as written.

Every fenced ```python block of README.md and docs/*.md runs, each in a fresh namespace with a
temporary directory as its working directory, CUDA hidden. A block that cannot run on a CPU says
so in its first line, `# doc-test: skip (needs CUDA)`, and is skipped with that reason. Every
`coatstate.X` name the docs mention resolves (an attribute or a module), and every
`torch.ops.coatstate.X` is a registered op.

KNOWN_FAILING_BLOCKS and KNOWN_UNRESOLVED list what fails in today's docs, with the reason; those
are reported as xfail while they fail and pass once fixed. Anything else that fails, fails.
"""

from __future__ import annotations

import hashlib
import importlib
import pkgutil
import re
import warnings
from pathlib import Path

import pytest
import torch
from coatstate.formats import schema

import coatstate
import coatstate.checkpoint

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_MARKER = re.compile(r"#\s*doc-test:\s*skip\b\s*(.*)")

# (doc, sha256 of the block's text) -> why it fails; an edited block no longer matches and must run
KNOWN_FAILING_BLOCKS: dict[tuple[str, str], str] = {}
# name -> where it is mentioned and why it does not resolve
KNOWN_UNRESOLVED: dict[str, str] = {}


def _doc_name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _python_blocks() -> list[tuple[str, int, str]]:
    """(doc, line of the opening fence, code) of every ```python block."""
    blocks = []
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"^```python[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
            blocks.append((_doc_name(path), text.count("\n", 0, m.start()) + 1, m.group(1)))
    return blocks


def _block_key(doc: str, code: str) -> tuple[str, str]:
    return doc, hashlib.sha256(code.encode()).hexdigest()[:8]


def _run_block(doc: str, line: int, code: str) -> None:
    first = next((s.strip() for s in code.splitlines() if s.strip()), "")
    marker = SKIP_MARKER.match(first)
    if marker:
        pytest.skip(f"{doc}:{line}: {marker.group(1) or 'marked doc-test: skip'}")
    known = KNOWN_FAILING_BLOCKS.get(_block_key(doc, code))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a doc's warnings are not its failures
            exec(compile(code, f"{doc}:{line}", "exec"), {"__name__": "__doc_block__"})
    except Exception as e:
        if known:
            pytest.xfail(f"{doc}:{line}: {known} ({type(e).__name__}: {e})")
        raise AssertionError(
            f"the ```python block at {doc}:{line} fails ({type(e).__name__}: {e}); fix it, or mark a "
            "block that cannot run on a CPU with a first line `# doc-test: skip (why)`"
        ) from e


@pytest.mark.parametrize(
    "doc, line, code", _python_blocks(), ids=[f"{d}:{n}" for d, n, _ in _python_blocks()]
)
def test_python_block_runs(doc, line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))  # the quick start writes under ~
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path, on any machine
    _run_block(doc, line, code)


def test_a_marked_block_is_skipped_with_its_reason_and_a_failing_one_fails():
    with pytest.raises(pytest.skip.Exception, match=r"x.md:3: \(needs CUDA\)"):
        _run_block("x.md", 3, "\n# doc-test: skip (needs CUDA)\nraise RuntimeError('never run')\n")
    with pytest.raises(AssertionError, match="x.md:3 fails .RuntimeError: broken"):
        _run_block("x.md", 3, "raise RuntimeError('broken')\n")


def _mentioned_names() -> list[str]:
    """Every `coatstate.a.b` and `torch.ops.coatstate.a` in the docs (not file names like x_coatstate.pt)."""
    names = set()
    for path in DOCS:
        names.update(
            m.group(0)
            for m in re.finditer(r"(?<![\w/.-])(?:torch\.ops\.)?coatstate(?:\.\w+)+", path.read_text())
        )
    return sorted(names)


def _metadata_keys() -> set[str]:
    """String constants such as 'coatstate.header_sha256': keys in a file's metadata, not names."""
    modules = [schema] + [
        importlib.import_module(m.name)
        for m in pkgutil.iter_modules(coatstate.checkpoint.__path__, "coatstate.checkpoint.")
    ]
    return {v for m in modules for v in vars(m).values() if isinstance(v, str) and v.startswith("coatstate.")}


def _resolve(name: str) -> object:
    if name.startswith("torch.ops."):
        importlib.import_module("coatstate.kernels.ops")  # registers the ops
        return getattr(torch.ops.coatstate, name.rsplit(".", 1)[1])
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            try:
                obj = importlib.import_module(".".join(parts[:i]))  # a submodule not imported yet
            except ModuleNotFoundError:
                raise e from None  # the attribute's own message (a moved name says where it went)
    return obj


# metadata keys such as coatstate.header_sha256 (docs/CHECKPOINT.md) are strings, not names
@pytest.mark.parametrize("name", [n for n in _mentioned_names() if n not in _metadata_keys()])
def test_every_coatstate_name_in_the_docs_resolves(name):
    try:
        _resolve(name)
    except (AttributeError, ImportError) as e:
        if name in KNOWN_UNRESOLVED:
            pytest.xfail(f"{KNOWN_UNRESOLVED[name]} ({e})")
        where = [_doc_name(p) for p in DOCS if name in p.read_text()]
        raise AssertionError(f"{name}, mentioned in {where}, does not resolve: {e}") from e


def test_dir_shows_the_public_names_subpackages_and_dunders_only():
    listed = set(dir(coatstate))
    public = set(coatstate.__all__) | set(coatstate._SUBPACKAGES)
    assert public <= listed
    extra = {n for n in listed - public if not (n.startswith("__") and n.endswith("__"))}
    assert not extra, f"dir(coatstate) lists non-public names: {sorted(extra)}"


PUBLIC_DOCSTRINGS = {  # name -> the sections its help() must show
    "compress_activations": ("Args:", "Returns:", "Raises:", "Example:"),
    "CompiledActivations": ("Args:", "Returns:", "Raises:", "Example:"),
    "ActivationPolicy": ("Args:", "Returns:", "Raises:", "Example:"),
    "ActivationStats": ("Attributes:", "Returns:", "Example:"),  # a result: nothing to raise
    "convert_to_fp8": ("Args:", "Returns:", "Raises:", "Example:"),
    "cast_model": ("Args:", "Returns:", "Raises:", "Example:"),
    "FP8Linear": ("Args:", "Returns:", "Raises:", "Example:"),
    "FP8LinearConfig": ("Args:", "Returns:", "Raises:", "Example:"),
    "FP8Format": ("Args:", "Returns:", "Raises:", "Example:"),
    "HostOffloadAdamW": ("Args:", "Returns:", "Raises:", "Example:"),
}


@pytest.mark.parametrize("name", sorted(PUBLIC_DOCSTRINGS))
def test_public_docstring_has_args_returns_raises_example(name):
    import pydoc

    text = pydoc.render_doc(getattr(coatstate, name), renderer=pydoc.plaintext)
    missing = [s for s in PUBLIC_DOCSTRINGS[name] if s not in text]
    assert not missing, f"help(coatstate.{name}) has no {missing} section"
    example = text.split("Example:", 1)[1]
    assert ">>> " in example.split("\n\n")[0] + example[:400], f"coatstate.{name}'s Example holds no code"


def _architecture_tree() -> set[str]:
    """The paths docs/ARCHITECTURE.md's tree names (two spaces of indent per level)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("## The tree", 1)[1].split("```", 2)[1]
    paths, stack = set(), []
    for line in block.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        name = line.split()[0]
        stack = [*stack[:depth], name.rstrip("/")]
        paths.add("/".join(stack))
    return paths


def test_architecture_names_every_module():
    """Issue #49: docs/ARCHITECTURE.md's tree lists every module of coatstate/, formats/ and
    kernels/ (a package's __init__.py only re-exports, so it may go unnamed), and nothing that is gone."""
    tree = _architecture_tree()
    modules = {
        p.relative_to(ROOT).as_posix()
        for top in ("coatstate", "formats", "kernels")
        for p in (ROOT / top).rglob("*.py")
        if p.name != "__init__.py" or p.parent.name == "coatstate"
    }
    missing = sorted(modules - tree)
    assert not missing, f"docs/ARCHITECTURE.md's tree does not name {missing}: add a line for each"
    gone = sorted(p for p in tree if p.endswith(".py") and not (ROOT / p).exists())
    assert not gone, f"docs/ARCHITECTURE.md names modules that are not there: {gone}"


def test_generated_tables_are_the_json_s():
    """The tables between <!-- table:NAME --> markers of the README and docs pages are what
    benchmarks/report.py makes of benchmarks/results/*.json today (rerun it after a new result),
    and the README holds no dated prose."""

    from report import DOCS_WITH_TABLES, marked_blocks, tables

    generated = tables()
    for page in DOCS_WITH_TABLES:
        for name, block in marked_blocks((ROOT / page).read_text()).items():
            stale = f"{page}'s table {name} is stale: run benchmarks/report.py"
            assert block == generated[name] + "\n", stale
    readme = (ROOT / "README.md").read_text()
    assert set(marked_blocks(readme)) == {"accuracy-summary", "headline", "one-gpu", "cpu-step"}
    prose = re.sub(r"<!-- table:([\w-]+) -->.*?<!-- /table:\1 -->", "", readme, flags=re.S)
    assert not re.search(r"20\d\d-\d\d-\d\d", prose), "a date in the README's prose: it belongs in docs/"
    assert "not understood" not in readme and "not re-run" not in readme
    # (+15 and +5 lines for SGD, Lion and Muon: issue #51 asks for the README's Muon split)
    assert len(readme.splitlines()) <= 165 and len((ROOT / "CHANGELOG.md").read_text().splitlines()) <= 125


def test_benchmarks_page_is_the_json_s(monkeypatch, tmp_path):
    """docs/benchmarks.md is what benchmarks/report.py makes of the kept results today: one section
    per file in benchmarks/results/, each registered in report.SECTIONS with a script that exists."""

    pytest.importorskip("matplotlib")
    import report
    import report_common

    kept = {p.stem for p in report.RESULTS.glob("*.json")}
    assert kept <= set(report.SECTIONS), f"results without a section: {sorted(kept - set(report.SECTIONS))}"
    assert set(report.SECTIONS) <= kept, "a section without its result"
    for script in re.findall(r"benchmarks/(\w+)\.py", (ROOT / "docs" / "benchmarks.md").read_text()):
        assert (ROOT / "benchmarks" / f"{script}.py").exists(), f"docs/benchmarks.md cites {script}.py"
    for module in (report, report_common):  # figures to tmp_path, not docs/img
        monkeypatch.setattr(module, "IMG", tmp_path)
    assert report.page() == (ROOT / "docs" / "benchmarks.md").read_text(), "run benchmarks/report.py"
