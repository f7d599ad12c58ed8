"""Weights written outside the optimizer: a master correction that no longer fits its weight.

With master_bits=24 or 32 a bfloat16 weight w stands for its float32 master together with the
correction c in the optimizer's state; c is only meaningful beside the w it was split from. When
something else writes w (model.load_state_dict, an EMA or SWA swap, `p.copy_` under no_grad),
the next step would rebuild the master as new w + old c. So after every step each such
parameter's version counter and address are recorded, and a step that finds them changed drops
that parameter's correction first: the master becomes the new weight, as in a fresh optimizer.

torch bumps a tensor's version counter on every in-place write through it or a view of it
(copy_, load_state_dict, nn.init), and `p.data = t` changes its address. A write through
`p.data` (`p.data.copy_(t)`) is invisible: `.data` is a tensor with a version counter of its
own, by torch's design, so it is not seen here either.

A correction created or loaded (opt.load_state_dict, coatstate.load) is trusted until the step
after it: a resume loads the model's weights and the optimizer's corrections in either order.
"""

from __future__ import annotations

import logging

import torch

from coatstate.distributed import local_tensor
from coatstate.formats.optimizer_state import MASTER_CORRECTION

logger = logging.getLogger("coatstate")


_PLAIN = (torch.nn.Parameter, torch.Tensor)


def _marks(params: list) -> list[tuple[int, ...]]:
    """Each parameter's version counter and address (a DTensor's writes may reach its wrapper or
    only its local shard: both counted). Run twice per step over every such parameter, so cheap."""
    return [
        (p._version, p.data_ptr())
        if type(p) in _PLAIN
        else (p._version, local_tensor(p)._version, local_tensor(p).data_ptr())
        for p in params
    ]


class ExternalWrites:
    """Per parameter with a master correction: its version and address after its last step."""

    def __init__(self) -> None:
        self._after_step: dict[int, tuple[int, ...]] = {}

    def forget(self) -> None:
        """A load replaced the states: their corrections are trusted until the next step."""
        self._after_step.clear()

    @torch.compiler.disable  # version counters are not traceable; a few integers per parameter
    def drop_stale(self, params: list, state: dict, name_of) -> None:
        """Zero the correction of each of `params` written outside the optimizer since its last step."""
        seen = self._after_step
        for p, mark in zip(params, _marks(params), strict=True):
            if seen.get(id(p), mark) == mark:
                continue
            correction = state[p].get(MASTER_CORRECTION)
            if correction is not None:
                local_tensor(correction).zero_()
                logger.debug(
                    "coatstate: %s was written outside the optimizer since its last step; its master "
                    "correction no longer fits it and is dropped (the master is the weight as it is now)",
                    name_of(p),
                )

    @torch.compiler.disable
    def record(self, params: list) -> None:
        """`params` have just stepped: their current version and address are the optimizer's own."""
        self._after_step.update(zip(map(id, params), _marks(params), strict=True))
