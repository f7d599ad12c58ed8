"""`coatstate clean URL [--yes]`: what killed saves left next to a checkpoint (rank_cleanup.sweep)."""

from __future__ import annotations

import argparse

from coatstate.cli.common import human_bytes


def add_clean_parser(sub) -> None:
    """Register `clean` on the `coatstate` subcommand parser."""
    k = sub.add_parser(
        "clean",
        help="list (--yes: remove) the files next to a checkpoint that its root does not name",
        description="Remove what killed saves left next to a checkpoint: rank files of other save ids, "
        "orphan shards, temp files and markers of its stem that the root does not name; never the root, "
        "a file it names, or another checkpoint's file. Prints each such file with its size and their total "
        "(without --yes only listed, nothing removed), and each file kept with the reason. Run it "
        "only while no save to URL is running: on s3 and other object stores nothing tells a killed "
        "save's files from a running one's (locally, files whose writer holds its lock are kept). "
        "Without a readable root it removes nothing (exit 1).",
    )
    k.add_argument("file", metavar="URL", help="the checkpoint's root .safetensors (path or fsspec URL)")
    k.add_argument("--yes", action="store_true", help="remove the files (default: only list them)")
    k.set_defaults(run=cmd_clean)


def cmd_clean(args: argparse.Namespace) -> int:
    from coatstate.checkpoint import rank_cleanup

    url = args.file
    found = rank_cleanup.sweep(url, dry_run=not args.yes)
    total = sum(size for _, size in found.removed)
    if not found.removed:
        print(f"{url}: nothing to remove")
    else:
        what = "removed" if args.yes else "would remove (a dry run; --yes removes them)"
        print(f"{url}: {what} {len(found.removed)} files no root names, {human_bytes(total)}:")
        for name, size in found.removed:
            print(f"  {human_bytes(size):>12}  {name}")
    for name, why in found.kept:
        print(f"  kept          {name} ({why})")
    return 0
