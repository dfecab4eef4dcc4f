"""The ring (and symmetric-buffer) decompositions behind pyzero.tp.overlap, and the
forward and backward computations of its three overlapped ops on a pz Group.

overlap.py wraps these in autograd functions; pyzero.ops registers them as torch
operators (torch.ops.pyzero.*) so that a compiled model runs the same code.
"""
from __future__ import annotations

import math
import weakref

import torch

from .. import comm, symmetric


def _neighbours(g: comm.Group) -> tuple[int, int]:
    n, r = g.size, g.rank
    return g.ranks[(r + 1) % n], g.ranks[(r - 1) % n]


# [Note: ring scratch buffers]
# A fresh multi-MB CPU tensor pays a page fault per 4 KiB page on first touch
# (about 0.2 ms per MB on the 2-core CI box: as long as the copy it then holds).
# Like Megatron's global memory buffer, the rings keep their scratch (gathered
# blocks, partial sums in flight) in buffers kept per group and name, reused by
# the next call; tensors handed back to the caller are always fresh. Safe
# because a ring waits for all of its transfers before it returns and the calls
# on one group run one after another.
_scratch_by_group: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _scratch(g: comm.Group, name: str, shape: tuple, like: torch.Tensor) -> torch.Tensor:
    bufs = _scratch_by_group.setdefault(g, {})
    numel = math.prod(shape)
    buf = bufs.get(name)
    if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
        with torch.inference_mode(False):  # (made in an inference_mode forward it could not be written after)
            buf = bufs[name] = like.new_empty(numel)
    return buf[:numel].view(shape)


def _wait(works) -> None:
    for w in works:
        w.wait()


def ring_all_gather(x2: torch.Tensor, g: comm.Group, on_block, out: torch.Tensor | None = None) -> torch.Tensor:
    """All-gather the row blocks `x2` (M, k) into `out` (n*M, k), calling
    ``on_block(c, block_c)`` for each block as soon as it is here, while the
    next one is in flight."""
    n, r, m = g.size, g.rank, x2.shape[0]
    if out is None:
        out = x2.new_empty((n * m, *x2.shape[1:]))
    blocks = [out[c * m:(c + 1) * m] for c in range(n)]  # row slices: contiguous views
    blocks[r].copy_(x2)
    nxt, prv = _neighbours(g)
    for s in range(n):
        c = (r - s) % n
        works = []
        if s < n - 1:  # pass block c on and fetch block c-1, which rank r-1 holds now
            works = comm.batch_isend_irecv([comm.P2POp("send", blocks[c], nxt, g),
                                            comm.P2POp("recv", blocks[(c - 1) % n], prv, g)])[:1]
        try:
            on_block(c, blocks[c])
        finally:
            _wait(works)  # every rank posted the same transfers: finish them even if compute failed
    return out


def ring_reduce_scatter(partial, m: int, o: int, like: torch.Tensor, g: comm.Group) -> torch.Tensor:
    """Reduce-scatter over row blocks of a sum of per-rank products, computed
    block by block: ``partial(c, out)`` writes this rank's (M, o) contribution
    to row block c into `out`. Returns this rank's block of the sum."""
    n, r = g.size, g.rank
    # Two scratch partial sums (one is being sent while the other is computed) and the
    # incoming one; the last step writes a fresh tensor, the result. See [Note: ring scratch buffers].
    parts = [_scratch(g, f"partial{i}", (m, o), like) for i in range(2 if n > 1 else 0)]
    incoming = _scratch(g, "incoming", (m, o), like) if n > 1 else None
    nxt, prv = _neighbours(g)
    moving = None  # step s-1's partial sum on its way to rank r+1 and step s's arriving from r-1
    for s in range(n):
        c = (r - 1 - s) % n
        part = like.new_empty((m, o)) if s == n - 1 else parts[s % 2]  # free: its send (step s-2) was waited for
        try:
            partial(c, part)
        finally:
            if moving is not None:  # every rank posted the same transfers: finish them even if compute failed
                _wait(moving)
        if s > 0:
            part += incoming
        if s < n - 1:  # one batch: NCCL needs the send and the receive grouped (see batch_isend_irecv)
            moving = comm.batch_isend_irecv([comm.P2POp("send", part, nxt, g),
                                             comm.P2POp("recv", incoming, prv, g)])[:1]
    return part


def gather_blocks(x2: torch.Tensor, g: comm.Group, on_block) -> None:
    """``on_block(c, block_c)`` for every row block of all_gather(x2), each as
    soon as it is here: in place from symmetric buffers where the group has
    them, else over the send/recv ring."""
    if symmetric.supported(g):
        symmetric.all_gather_apply(x2, g, on_block)
    else:  # see [Note: ring scratch buffers]
        ring_all_gather(x2, g, on_block, out=_scratch(g, "gathered", (g.size * x2.shape[0], *x2.shape[1:]), x2))


def reduce_scatter_blocks(partial, m: int, o: int, like: torch.Tensor, g: comm.Group) -> torch.Tensor:
    """This rank's (M, o) block of the sum of per-rank contributions ``partial(c, out)``:
    from symmetric buffers where the group has them, else over the ring."""
    if symmetric.supported(g):
        return symmetric.reduce_scatter_apply(partial, m, o, like, g)
    return ring_reduce_scatter(partial, m, o, like, g)


def ring_matmul_reduce_scatter(x2: torch.Tensor, weight: torch.Tensor, g: comm.Group) -> torch.Tensor:
    """reduce_scatter over row blocks of (x2 @ weight.T); x2 is (n*M, k), the result (M, o)."""
    m, wt = x2.shape[0] // g.size, weight.t()

    def partial(c, out):
        torch.matmul(x2[c * m:(c + 1) * m], wt, out=out)  # (M, k) @ (k, o) -> (M, o)

    return reduce_scatter_blocks(partial, m, weight.shape[0], x2, g)


# ---------------------------------------------------------------------------
# The overlapped ops' forward and backward (see the autograd functions of overlap.py)


def all_gather_matmul_forward(x_shard: torch.Tensor, weight: torch.Tensor, g: comm.Group) -> torch.Tensor:
    """all_gather(x_shard, dim 0) @ weight.T, block by block as the blocks arrive."""
    k = x_shard.shape[-1]
    x2 = x_shard.contiguous().view(-1, k)
    y = x2.new_empty((g.size * x2.shape[0], weight.shape[0]))
    m, wt = x2.shape[0], weight.t()

    def mm(c, block):
        torch.matmul(block, wt, out=y[c * m:(c + 1) * m])  # (M, k) @ (k, o) -> (M, o)

    gather_blocks(x2, g, mm)
    return y.view(g.size * x_shard.shape[0], *x_shard.shape[1:-1], weight.shape[0])


def all_gather_matmul_backward(grad: torch.Tensor, x_shard: torch.Tensor, weight: torch.Tensor,
                               g: comm.Group) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx_shard, dweight) of all_gather_matmul_forward."""
    k = x_shard.shape[-1]
    x2 = x_shard.contiguous().view(-1, k)
    dy = grad.contiguous().view(-1, weight.shape[0])  # (n*M, o)
    m = x2.shape[0]
    rows = [slice(c * m, (c + 1) * m) for c in range(g.size)]
    # dx: the blocks of dy @ w, reduce-scattered block by block (as matmul_reduce_scatter)
    dx = reduce_scatter_blocks(lambda c, out: torch.matmul(dy[rows[c]], weight, out=out), m, k, x2, g)
    dw = weight.new_zeros(weight.shape)  # (contiguous, as the fake kernel says: pyzero.ops)
    gather_blocks(x2, g, lambda c, xc: dw.addmm_(dy[rows[c]].t(), xc))  # dw += dy[c].T @ x[c] as x[c] comes
    return dx.view(x_shard.shape), dw


def matmul_reduce_scatter_forward(x: torch.Tensor, weight: torch.Tensor, g: comm.Group) -> torch.Tensor:
    """reduce_scatter(x @ weight.T, dim 0), the partial sums passed around the ring."""
    x2 = x.contiguous().view(-1, x.shape[-1])
    y = ring_matmul_reduce_scatter(x2, weight, g)
    return y.view(x.shape[0] // g.size, *x.shape[1:-1], weight.shape[0])


def matmul_reduce_scatter_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                   g: comm.Group) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of matmul_reduce_scatter_forward: dy gathered block by block."""
    x2 = x.contiguous().view(-1, x.shape[-1])
    dy = grad.contiguous().view(-1, weight.shape[0])  # (M, o)
    m = dy.shape[0]
    dx = torch.empty_like(x2)
    dw = weight.new_zeros(weight.shape)  # (contiguous, as the fake kernel says: pyzero.ops)

    def grads(c, block):
        rows = slice(c * m, (c + 1) * m)
        torch.matmul(block, weight, out=dx[rows])  # (M, o) @ (o, k) -> (M, k)
        dw.addmm_(block.t(), x2[rows])  # (o, M) @ (M, k) -> (o, k)

    gather_blocks(dy, g, grads)
    return dx.view(x.shape), dw


def linear_all_reduce_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                               g: comm.Group) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of x @ weight.T whose dx is summed over the group, the sum overlapping dw."""
    dy = grad.contiguous().view(-1, weight.shape[0])  # (M, o)
    dx = dy @ weight  # (M, o) @ (o, k) -> (M, k)
    reducing = comm.all_reduce(dx, op="sum", group=g, async_op=True)
    dw = dy.t() @ x.reshape(-1, x.shape[-1])  # (o, M) @ (M, k) -> (o, k), while dx is all-reduced
    reducing.wait()
    return dx.view(x.shape), dw
