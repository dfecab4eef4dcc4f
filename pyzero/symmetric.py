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

import torch

from . import comm

_MIN_BYTES = 1 << 20


def supported(g: comm.Group) -> bool:
    """Whether `g` runs fused ops on symmetric buffers: a backend that has them (shm), 2+ ranks, and
    the group's ``symmetric`` option on (default; ``PYZERO_SYMMETRIC=0`` turns it off, so the TP ops
    use their send/recv ring)."""
    return (g.size > 1 and g.backend.has_symmetric
            and g.options.get("symmetric", True, "PYZERO_SYMMETRIC"))


class SymmetricBuffer:
    """A group's symmetric buffers and its fused-call counter (one per group)."""

    def __init__(self, g: comm.Group):
        self.g = g
        self.bytes = 0
        self.calls = 0
        self.views: list[torch.Tensor] = []  # uint8, one per rank of g
        self._typed: dict = {}  # (rank, dtype, shape) -> view: fused calls repeat their shapes

    def begin(self, kind: str, like: torch.Tensor, dims: tuple[int, ...], nbytes: int) -> int:
        """Enter a fused call (collective) with room for `nbytes` per rank; returns the
        call's base `ready` value (values base+1 .. base+n mark its progress)."""
        be = self.g.backend
        be.sym_arrive(kind, like, dims, math.prod(dims))
        # Equal dims on every rank (checked above): the same choice everywhere. A first call of
        # 0 bytes maps the buffers too, so that its (empty) views exist.
        if nbytes > self.bytes or not self.views:
            with torch.inference_mode(False):  # (cached views: made in an inference_mode forward, they could not
                # be written after it)
                self.views = be.sym_grow(max(nbytes, 2 * self.bytes, _MIN_BYTES), lambda: comm.barrier(group=self.g))
            self.bytes = be.sym_bytes()
            self._typed = {}
        self.calls += 1
        return self.calls * (self.g.size + 1)

    def view(self, r: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Rank r's buffer as a (shape) tensor of dtype, from its start."""
        key = (r, dtype, shape)
        v = self._typed.get(key)
        if v is None:
            if len(self._typed) > 256:
                self._typed.clear()
            nbytes = math.prod(shape) * dtype.itemsize
            with torch.inference_mode(False):
                v = self._typed[key] = self.views[r][:nbytes].view(dtype).view(shape)
        return v


def _buffer(g: comm.Group) -> SymmetricBuffer:
    if g.symmetric is None:
        g.symmetric = SymmetricBuffer(g)
    return g.symmetric


def all_gather_apply(x2: torch.Tensor, g: comm.Group, on_block) -> None:
    """Call ``on_block(c, block_c)`` for each (m, k) row block c of the all-gather of
    `x2` (m, k), every rank's x2 having the same shape: the own block is x2, a
    peer's is a read-only view of its buffer, valid during the call only."""
    n, r = g.size, g.rank
    buf = _buffer(g)
    x2 = x2.contiguous()
    base = buf.begin("all_gather", x2, tuple(x2.shape), x2.numel() * x2.element_size())
    c = g.backend
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
    base = buf.begin("reduce_scatter", like, (n, m, o), n * m * o * es)
    c = g.backend
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
