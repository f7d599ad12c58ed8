"""The `coatstate` command: the parser and the dispatch to one module per command (`inspect`,
`convert`, `clean`, `plan`; helpers they share in coatstate.cli.common).

Exit codes: 0 success, 1 a checkpoint problem (unreadable, corrupt, mismatched: one line on
stderr naming the file), 2 a usage error (one line). Nothing heavy is imported at module level:
the parser builds, and every --help prints, without importing torch.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import warnings

from coatstate.cli.clean import add_clean_parser
from coatstate.cli.common import UsageError, printable
from coatstate.cli.convert import add_convert_parser
from coatstate.cli.inspect import add_inspect_parser
from coatstate.cli.plan import add_plan_parser

DEBUG_ENV = "COATSTATE_TRACEBACK"
"""Set to 1 to get the traceback of an unexpected error instead of its one-line summary."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr and exit code 2 (subparsers inherit it)."""

    def error(self, message: str):
        print(f"{self.prog}: usage error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    from coatstate import __version__

    p = _Parser(
        prog="coatstate",
        description="coatstate checkpoints and memory: `inspect` what a checkpoint holds, `convert` between "
        "torch AdamW and compressed (FP8) optimizer states, `clean` what killed saves left next to a "
        "checkpoint, `plan` a training job's memory per GPU.",
        epilog="Exit codes: 0 ok, 1 a checkpoint problem (one line on stderr), 2 a usage error.",
    )
    p.add_argument(
        "--version", action="version", version=f"coatstate {__version__}", help="print the version"
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="{inspect,convert,clean,plan}")
    add_inspect_parser(sub)
    add_convert_parser(sub)
    add_clean_parser(sub)
    add_plan_parser(sub)
    return p


def _one_line(e: BaseException, files: list[str]) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if files and not any(f and f in text for f in files):
        text = f"{files[0]}: {text}"
    return printable(text)  # (a path may hold a newline or an escape: still one line)


def _quiet_stdout() -> None:
    """After a closed pipe (`| head`): later writes and the exit flush go nowhere, silently."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed the usage message (or the help)
        return int(e.code or 0)
    files = [
        f for f in (getattr(args, n, None) for n in ("file", "src", "dst", "model")) if isinstance(f, str)
    ]
    # torch's CPU wheel warns on import that numpy is missing; no command here needs numpy
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    try:
        code = args.run(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # the reader stopped reading: not an error of ours
        _quiet_stdout()
        return 0
    except UsageError as e:
        print(f"coatstate: usage error: {_one_line(e, [])}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, ImportError, TypeError, OSError, RecursionError, MemoryError) as e:
        # CheckpointError is a ValueError
        print(f"coatstate: error: {_one_line(e, files)}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - never a traceback; the summary names the error
        if os.environ.get(DEBUG_ENV) == "1":
            raise
        print(
            f"coatstate: error: {_one_line(e, files)} ({type(e).__name__}; an unexpected error, please "
            f"report it; {DEBUG_ENV}=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1
