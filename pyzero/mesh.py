"""DP x TP process grid.

Rank r sits at (dp index, tp index) = (r // tp, r % tp): TP ranks are
adjacent, because TP communicates on every layer and adjacent ranks share the
fastest links (one node, NVLink); DP only syncs gradients once per step.

    world 4, dp=2, tp=2:   tp groups [0, 1], [2, 3];  dp groups [0, 2], [1, 3]
"""
from __future__ import annotations

from . import comm


def _axis_size(value, axis: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{axis}: expected an int mesh axis size, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{axis}: expected a positive mesh axis size, got {value}")
    return value


def mesh(dp: int = 1, tp: int = 1) -> tuple[comm.Group, comm.Group]:
    """This rank's (dp_group, tp_group) in a DP x TP grid over the world.

    Every rank must call it (it creates every group of the grid, in the same
    order on every rank); ``dp * tp`` must equal the world size.
    """
    dp, tp = _axis_size(dp, "dp"), _axis_size(tp, "tp")
    world = comm.get_world_size()
    if dp * tp != world:
        raise ValueError(f"mesh(dp={dp}, tp={tp}): dp * tp = {dp * tp} must equal the world size {world}")
    rank = comm.get_rank()
    tp_group = dp_group = None
    for i in range(dp):
        g = comm.new_group(range(i * tp, (i + 1) * tp))
        if rank in g.ranks:
            tp_group = g
    for j in range(tp):
        g = comm.new_group(range(j, world, tp))
        if rank in g.ranks:
            dp_group = g
    return dp_group, tp_group
