"""DP x TP process grid.

Rank r sits at (dp index, tp index) = (r // tp, r % tp): TP ranks are
adjacent, because TP communicates on every layer and adjacent ranks share the
fastest links (one node, NVLink); DP only syncs gradients once per step.

    world 4, dp=2, tp=2:   tp groups [0, 1], [2, 3];  dp groups [0, 2], [1, 3]
"""
from __future__ import annotations

from . import comm
from .checks import is_int


def _axis_size(value, axis: str) -> int:
    if not is_int(value):
        raise TypeError(f"{axis}: expected an int mesh axis size, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{axis}: expected a positive mesh axis size, got {value}")
    return value


def _check(dp, tp, world: int) -> Exception | None:
    try:
        dp, tp = _axis_size(dp, "dp"), _axis_size(tp, "tp")
    except (TypeError, ValueError) as e:
        return e
    if dp * tp != world:
        return ValueError(f"mesh(dp={dp}, tp={tp}): dp * tp = {dp * tp} must equal the world size {world}")
    return None


def mesh(dp: int = 1, tp: int = 1) -> tuple[comm.Group, comm.Group]:
    """This rank's (dp_group, tp_group) in a DP x TP grid over the world.

    Every rank must call it (it creates every group of the grid, in the same
    order on every rank); ``dp * tp`` must equal the world size. The ranks
    first compare their (dp, tp): a bad or differing value on any rank raises
    on every rank.
    """
    world = comm.get_world_size()
    err = _check(dp, tp, world)
    rows = [tuple(row) for row in comm.every_rank([-1, -1] if err else [dp, tp]).tolist()]
    if err is not None:
        raise err
    bad = [r for r, row in enumerate(rows) if row == (-1, -1)]
    if bad:
        raise ValueError(f"mesh: global rank {bad[0]} passed an invalid dp or tp; expected positive ints with "
                         f"dp * tp = {world} on every rank")
    if len(set(rows)) > 1:
        raise ValueError(f"mesh: expected the same dp and tp on every rank, got {rows} (by global rank)")
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
