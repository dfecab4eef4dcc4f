"""Symmetric buffers: fused ops whose ranks read each other's blocks in place.

On the shm backend every rank of a group can map a buffer of every peer
(csrc/shm_transport.h, [Note: symmetric buffers]). A fused op then moves
each block once: its owner writes it into its own buffer, and the ranks that
need it compute straight from there, the way NVLink peer reads (or PyTorch's
SymmetricMemory) let async tensor parallelism skip the staging copies of a
send/recv ring. The ring's order is kept: a rank starts on the block it
already has while its peers are still writing theirs.

all_gather_apply(x2, g, on_block)
    ``on_block(c, block_c)`` for every block c of all_gather(x2) without
    building the gathered tensor:
        copy x2 -> own buffer | ready | on_block(r, x2) | wait r-1, on_block(r-1, its buffer) | ...
reduce_scatter_apply(partial, m, o, like, g)
    this rank's (m, o) block of sum over ranks of their contributions;
    ``partial(c, out)`` writes this rank's contribution to block c into
    `out`, which for peers' blocks is the rank's own buffer (no staging
    copy), each announced as soon as written, in the order the peers
    need them; the own block's sum then reads the peers' in place:
        partial(r+1) -> buffer, ready | partial(r+2) ... | partial(r) -> out | out += r-1's | ...

Each call starts with an arrival like any collective of the group (a
mismatched fused call or a plain collective on another rank fails on
every rank), after which the previous call's reads are over everywhere.
"""
from __future__ import annotations

import math
import os

import torch

from . import comm

_GATHER, _REDUCE_SCATTER = 0, 1  # fused op kinds, as csrc/shm_transport.cpp names them
_MIN_BYTES = 1 << 20

# PYZERO_SYMMETRIC=0 makes the TP ops use their send/recv ring on shm too.
ENABLED = os.environ.get("PYZERO_SYMMETRIC", "1") != "0"


def supported(g: comm.Group) -> bool:
    """Whether `g` can run fused ops on symmetric buffers (the shm backend, 2+ ranks)."""
    return ENABLED and g.device is None and g.size > 1 and hasattr(g.comm(), "sym_arrive")


class SymmetricBuffer:
    """A group's symmetric buffers and its fused-call counter (one per group)."""

    def __init__(self, g: comm.Group):
        self.g = g
        self.bytes = 0
        self.calls = 0
        self.views: list[torch.Tensor] = []  # uint8, one per rank of g
        self._typed: dict = {}  # (rank, dtype, shape) -> view: fused calls repeat their shapes

    def begin(self, kind: int, like: torch.Tensor, dims: tuple[int, ...], nbytes: int) -> int:
        """Enter a fused call (collective) with room for `nbytes` per rank; returns the
        call's base `ready` value (values base+1 .. base+n mark its progress)."""
        c = self.g.comm()
        c.sym_arrive(kind, math.prod(dims), comm._check_tensor(like, "x"), list(dims))
        if nbytes > self.bytes:  # equal dims on every rank (checked above): the same choice everywhere
            self._grow(c, max(nbytes, 2 * self.bytes, _MIN_BYTES))
        self.calls += 1
        return self.calls * (self.g.size + 1)

    def _grow(self, c, nbytes: int) -> None:
        c.sym_create(nbytes)
        comm.barrier(group=self.g)
        c.sym_attach()
        comm.barrier(group=self.g)
        c.sym_unlink()  # every rank has mapped it: nothing left in /dev/shm
        self.bytes = c.sym_bytes()
        self.views = [torch.frombuffer(c.sym_buffer(r), dtype=torch.uint8) for r in range(self.g.size)]
        self._typed = {}

    def view(self, r: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Rank r's buffer as a (shape) tensor of dtype, from its start."""
        key = (r, dtype, shape)
        v = self._typed.get(key)
        if v is None:
            if len(self._typed) > 256:
                self._typed.clear()
            nbytes = math.prod(shape) * dtype.itemsize
            v = self._typed[key] = self.views[r][:nbytes].view(dtype).view(shape)
        return v


def _buffer(g: comm.Group) -> SymmetricBuffer:
    if g._symmetric is None:
        g._symmetric = SymmetricBuffer(g)
    return g._symmetric


def all_gather_apply(x2: torch.Tensor, g: comm.Group, on_block) -> None:
    """Call ``on_block(c, block_c)`` for each (m, k) row block c of the all-gather of
    `x2` (m, k), every rank's x2 having the same shape: the own block is x2, a
    peer's is a read-only view of its buffer, valid during the call only."""
    n, r = g.size, g.rank
    buf = _buffer(g)
    x2 = x2.contiguous()
    base = buf.begin(_GATHER, x2, tuple(x2.shape), x2.numel() * x2.element_size())
    c = g.comm()
    buf.view(r, x2.dtype, tuple(x2.shape)).copy_(x2)
    c.sym_signal(base + 1)
    on_block(r, x2)
    for s in range(1, n):
        p = (r - s) % n
        c.sym_wait(p, base + 1, "fused all_gather")
        on_block(p, buf.view(p, x2.dtype, tuple(x2.shape)))


def reduce_scatter_apply(partial, m: int, o: int, like: torch.Tensor, g: comm.Group) -> torch.Tensor:
    """This rank's block of the sum over ranks of per-rank contributions to n
    (m, o) row blocks; ``partial(c, out)`` writes this rank's contribution to
    block c into `out` (m, o). Returns a fresh (m, o) tensor."""
    n, r = g.size, g.rank
    buf = _buffer(g)
    es = like.element_size()
    base = buf.begin(_REDUCE_SCATTER, like, (n, m, o), n * m * o * es)
    c = g.comm()
    mine = buf.view(r, like.dtype, (n, m, o))
    for s in range(1, n):  # rank r+s adds block r+s at its step s: compute them in that order
        b = (r + s) % n
        partial(b, mine[b])
        c.sym_signal(base + s)
    out = like.new_empty((m, o))
    partial(r, out)
    for s in range(1, n):
        p = (r - s) % n  # wrote block r at its step s
        c.sym_wait(p, base + s, "fused reduce_scatter")
        out += buf.view(p, like.dtype, (n, m, o))[r]
    return out
