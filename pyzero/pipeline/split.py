"""Cut an nn.Sequential into pipeline stages of balanced cost.

The stages are contiguous runs of layers (a pipeline only passes activations
forward), so this is the linear-partition problem: choose num_stages - 1 cut
points minimising the most expensive stage. A dynamic program finds that
optimum; the cuts are then placed as late as the optimum allows, which keeps
zero-cost layers (activations, dropout) with the layer before them.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import NamedTuple, Sequence

from torch import nn
from ..checks import is_int, is_real


class StageInfo(NamedTuple):
    """Which stage of how many a module is; Pipeline checks it against its group."""

    index: int
    num_stages: int


def layer_costs(seq: nn.Sequential) -> list[int]:
    """Parameter count of each layer (a parameter shared by several layers counts in each)."""
    return [sum(p.numel() for p in layer.parameters()) for layer in seq]


def _check_costs(costs, n: int) -> list[float]:
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Sequence):
        raise TypeError(f"costs: expected a sequence of {n} numbers (one per layer), got {type(costs).__name__}")
    if len(costs) != n:
        raise ValueError(f"costs: expected {n} numbers (one per layer of seq), got {len(costs)}")
    out = []
    for i, c in enumerate(costs):
        if not is_real(c):
            raise TypeError(f"costs[{i}]: expected a number, got {type(c).__name__}")
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"costs[{i}]: expected a finite cost >= 0, got {c}")
        out.append(c)
    return out


def _check_shared_across(named, cuts) -> None:
    """A parameter or buffer that layers in two stages share (one module used twice, tied weights) would
    be each stage's own copy on its rank: their values would come apart. Refused; a stateless layer
    (an activation) may come again anywhere."""
    seen: dict[int, tuple[int, str]] = {}
    for stage in range(len(cuts) - 1):
        for name, layer in named[cuts[stage]:cuts[stage + 1]]:
            for t in list(layer.parameters()) + list(layer.buffers()):
                first = seen.setdefault(id(t), (stage, name))
                if first[0] != stage:
                    raise ValueError(f"seq: layers {first[1]!r} (stage {first[0]}) and {name!r} (stage {stage}) "
                                     "share a parameter or buffer, which the two stages' ranks would each hold "
                                     "a copy of, training apart; keep them in one stage (costs=) or untie them")


def _check_num_stages(num_stages, n: int, what: str) -> None:
    if not is_int(num_stages):
        raise TypeError(f"num_stages: expected an int, got {type(num_stages).__name__}")
    if not 1 <= num_stages <= n:
        raise ValueError(f"num_stages: expected 1 <= num_stages <= {what} = {n} (every stage needs a layer), "
                         f"got {num_stages}")


def balanced_cuts(costs: Sequence[float], num_stages: int) -> list[int]:
    """Stage boundaries [0, b1, ..., len(costs)] of a contiguous partition
    into num_stages non-empty parts whose largest sum is minimal.

    O(num_stages * n^2) time for n layers: a few ms for hundreds of layers.
    """
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Sequence):
        raise TypeError(f"costs: expected a sequence of numbers (one per layer), got {type(costs).__name__}")
    n = len(costs)
    costs = _check_costs(costs, n)
    _check_num_stages(num_stages, n, "len(costs)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int) -> float:  # layers i..j-1; the only sum used, so comparisons are exact
        return prefix[j] - prefix[i]

    # best[j]: the smallest possible max-stage cost of layers 0..j-1 cut into s stages.
    best = [cost(0, j) if j >= 1 else math.inf for j in range(n + 1)]
    for s in range(2, num_stages + 1):
        new = [math.inf] * (n + 1)
        for j in range(s, n + 1):
            new[j] = min(max(best[i], cost(i, j)) for i in range(s - 1, j))
        best = new
    limit = best[n]

    # Greedy from the front with the optimum as the bound: each stage takes as
    # many layers as fit and still leave one per later stage. Its cut points are
    # never earlier than an optimal partition's, so the last stage fits too.
    cuts, start = [0], 0
    for s in range(num_stages - 1):
        end = start + 1
        while end < n - (num_stages - s - 1) and cost(start, end + 1) <= limit:
            end += 1
        cuts.append(end)
        start = end
    cuts.append(n)
    return cuts


def split_sequential(seq: nn.Sequential, num_stages: int, costs=None) -> list[nn.Sequential]:
    """Split ``seq`` into ``num_stages`` contiguous, non-empty nn.Sequential stages.

    Balanced by parameter count, or by ``costs`` (one non-negative number per
    layer, e.g. measured forward times): the partition minimises the cost of
    the most expensive stage. The stages hold the original layers (no copies)
    under their original names, so ``stage.state_dict()`` keys match ``seq``'s.
    Each stage carries ``stage.pipeline_stage = StageInfo(index, num_stages)``,
    which ``Pipeline`` checks against its group.
    """
    if not isinstance(seq, nn.Sequential):
        raise TypeError(f"seq: expected an nn.Sequential, got {type(seq).__name__}")
    n = len(seq)
    _check_num_stages(num_stages, n, "len(seq)")
    costs = layer_costs(seq) if costs is None else _check_costs(costs, n)
    cuts = balanced_cuts(costs, num_stages)
    named = list(seq._modules.items())  # (named_children() skips a layer that comes again: a ReLU used twice)
    _check_shared_across(named, cuts)
    stages = []
    for index in range(num_stages):
        stage = nn.Sequential(OrderedDict(named[cuts[index]:cuts[index + 1]]))
        stage.pipeline_stage = StageInfo(index, num_stages)
        stages.append(stage)
    return stages
