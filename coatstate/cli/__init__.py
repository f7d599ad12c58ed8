"""The `coatstate` command: inspect, convert, clean and plan (coatstate.cli.main builds the parser)."""

from coatstate.cli.main import main

__all__ = ["main"]
