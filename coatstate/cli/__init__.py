"""The `coatstate` command: inspect, convert and plan (coatstate.cli.main builds the parser)."""

from coatstate.cli.main import main

__all__ = ["main"]
