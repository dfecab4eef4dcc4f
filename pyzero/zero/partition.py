"""Flat layouts and shard descriptors shared by the ZeRO stages and checkpoints.

A FlatLayout lays a list of parameters end to end (in the order given),
pads the total to a multiple of the world size and cuts it into equal
shards. Rank r owns [r * shard_size, (r + 1) * shard_size). A Piece is the
part of one parameter that falls into one rank's shard: the unit that
optimizer state, clipping and checkpoints work on, so a rank never needs the
other ranks' layout to know what its numbers mean.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class ShardInfo(NamedTuple):
    offset: int  # first element of the shard in the flat buffer
    size: int


@dataclass(frozen=True)
class Piece:
    """Elements [start, end) of parameter `name` (flattened), stored at flat[offset:offset + end - start]."""

    name: str
    index: int  # position of the parameter in the layout
    start: int
    end: int
    offset: int  # in the flat buffer

    @property
    def numel(self) -> int:
        return self.end - self.start


class FlatLayout:
    def __init__(self, params: list[torch.nn.Parameter], names: list[str], world: int):
        if len(params) != len(names):
            raise ValueError("FlatLayout: one name per parameter")
        self.params, self.names, self.world = params, names, world
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.shard_size = -(-total // world) if total else 0
        self.padded = self.shard_size * world

    def shard(self, rank: int) -> ShardInfo:
        return ShardInfo(rank * self.shard_size, self.shard_size)

    def counts(self, begin: int, end: int) -> list[int]:
        """Elements of [begin, end) that fall into each rank's shard (reduce-scatter counts)."""
        out = []
        for r in range(self.world):
            lo, hi = r * self.shard_size, (r + 1) * self.shard_size
            out.append(max(0, min(end, hi) - max(begin, lo)))
        return out

    def pieces(self, rank: int) -> list[Piece]:
        lo, hi = rank * self.shard_size, (rank + 1) * self.shard_size
        out = []
        for i, (name, p, off) in enumerate(zip(self.names, self.params, self.offsets)):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                out.append(Piece(name, i, a - off, b - off, a))
        return out

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's shape as a view into `flat` (the full, padded buffer)."""
        return [flat[o:o + p.numel()].view(p.shape) for p, o in zip(self.params, self.offsets)]


def trainable(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[str]]:
    """The model's trainable parameters, each once (tied ones under their first name), and
    their names, in registration order: what ZeRO and the parameter servers lay out."""
    seen, params, names = set(), [], []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
            names.append(name)
    if not params:
        raise ValueError("model: has no trainable parameters")
    return params, names
