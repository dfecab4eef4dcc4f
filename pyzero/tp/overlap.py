"""Tensor-parallel matmuls that overlap their communication with compute.

Rows (dim 0 of the activations, flattened with every dim but the last) are the
sequence-parallel axis: rank r of an n-rank group holds rows block r.

all_gather_matmul(x_shard, w):  y = all_gather(x_shard) @ w.T
    Before:  comm |== gather 0..n-1 ==|
             mm                       |== y = x @ w.T ==|
    Now (ring, n steps; c = (r - s) mod n is the block already here at step s):
             send/recv | c->r+1, (c-1)<-r-1 | ... |
             mm        |  y[c] = x[c] @ w.T | ... | y[last] |

matmul_reduce_scatter(x, w):    y = reduce_scatter(x @ w.T)
    Before:  mm   |== p = x @ w.T ==|
             comm                   |== reduce-scatter p ==|
    Now (ring; at step s rank r adds its partial of block c = (r - 1 - s) mod n
    to the accumulator from r-1 and passes it on; the last one is its own block):
             mm        | p[c0] | p[c1]              | ...
             send/recv |       |-> r+1, acc <- r-1  | ...
             add                                 +acc

On the shm backend the blocks are not sent at all: each rank writes its
block (or its partial sums) once into its symmetric buffer and the peers
compute straight from there, in the same ring order (pyzero/symmetric.py;
PYZERO_SYMMETRIC=0 turns it off). Elsewhere the transfers are async
pz.send/pz.recv to the ring neighbours, on pyzero's per-peer threads (or
side streams), so the matmul of the block already here runs while the next
block moves. Both ops are differentiable and their backward overlaps too
(see each Function's docstring).
"""
from __future__ import annotations

import math
import weakref

import torch

from .. import comm, symmetric
from .communications import tp_group


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


def _check_matmul(x, weight, x_arg: str, min_dim: int = 2):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{x_arg}: expected a torch.Tensor, got {type(x).__name__}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight: expected a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected 2 dims (out_features, in_features), got shape {tuple(weight.shape)}")
    if x.dim() < min_dim or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{x_arg}: expected shape (rows, ..., {weight.shape[1]}) to match weight "
                         f"{tuple(weight.shape)}, got {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"{x_arg}: dtype {x.dtype} does not match weight's {weight.dtype}")


class _AllGatherMatmul(torch.autograd.Function):
    """Column-parallel linear in an SP region: y = all_gather(x_shard) @ w.T.

    Backward (Megatron: the gathered input is not kept; it is gathered again):
        Before:  | gather x | dx = dy @ w | reduce-scatter dx | dw = dy.T @ x |
        Now:     dx = reduce-scatter of (dy @ w) block by block, as matmul_reduce_scatter
                 does; then x is gathered block by block and dw += dy[c].T @ x[c] for
                 each block c as soon as it is here.
    """

    @staticmethod
    def forward(ctx, x_shard, weight, g):
        ctx.g = g
        ctx.save_for_backward(x_shard, weight)
        k = x_shard.shape[-1]
        x2 = x_shard.contiguous().view(-1, k)
        y = x2.new_empty((g.size * x2.shape[0], weight.shape[0]))
        m, wt = x2.shape[0], weight.t()

        def mm(c, block):
            torch.matmul(block, wt, out=y[c * m:(c + 1) * m])  # (M, k) @ (k, o) -> (M, o)

        gather_blocks(x2, g, mm)
        return y.view(g.size * x_shard.shape[0], *x_shard.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x_shard, weight = ctx.saved_tensors
        g = ctx.g
        k = x_shard.shape[-1]
        x2 = x_shard.contiguous().view(-1, k)
        dy = grad.contiguous().view(-1, weight.shape[0])  # (n*M, o)
        m = x2.shape[0]
        rows = [slice(c * m, (c + 1) * m) for c in range(g.size)]
        # dx: the blocks of dy @ w, reduce-scattered block by block (as matmul_reduce_scatter)
        dx = reduce_scatter_blocks(lambda c, out: torch.matmul(dy[rows[c]], weight, out=out), m, k, x2, g)
        dw = torch.zeros_like(weight)
        gather_blocks(x2, g, lambda c, xc: dw.addmm_(dy[rows[c]].t(), xc))  # dw += dy[c].T @ x[c] as x[c] comes
        return dx.view(x_shard.shape), dw, None


class _MatmulReduceScatter(torch.autograd.Function):
    """Row-parallel linear into an SP region: y = reduce_scatter(x @ w.T).

    Backward: dy is all-gathered around the ring, and for each block c as it
    arrives both gradients' pieces are computed:
        Before:  | gather dy | dx = dy @ w | dw = dy.T @ x |
        Now:     send/recv | block c-1 in flight                 | ...
                 mm        | dx[c] = dy[c] @ w; dw += dy[c].T @ x[c] | ...
    """

    @staticmethod
    def forward(ctx, x, weight, g):
        ctx.g = g
        ctx.save_for_backward(x, weight)
        x2 = x.contiguous().view(-1, x.shape[-1])
        y = ring_matmul_reduce_scatter(x2, weight, g)
        return y.view(x.shape[0] // g.size, *x.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = ctx.g
        x2 = x.contiguous().view(-1, x.shape[-1])
        dy = grad.contiguous().view(-1, weight.shape[0])  # (M, o)
        m = dy.shape[0]
        dx = torch.empty_like(x2)
        dw = torch.zeros_like(weight)

        def grads(c, block):
            rows = slice(c * m, (c + 1) * m)
            torch.matmul(block, weight, out=dx[rows])  # (M, o) @ (o, k) -> (M, k)
            dw.addmm_(block.t(), x2[rows])  # (o, M) @ (M, k) -> (o, k)

        gather_blocks(dy, g, grads)
        return dx.view(x.shape), dw, None


class _LinearAsyncAllReduce(torch.autograd.Function):
    """Column-parallel linear without SP: y = x @ w.T (x replicated), i.e.
    Megatron's f followed by the matmul, with f's all-reduce overlapped.

    Backward:
        Before:  | dx = dy @ w | all-reduce dx | dw = dy.T @ x |
        Now:     mm   | dx = dy @ w | dw = dy.T @ x |
                 comm               | all-reduce dx |
    """

    @staticmethod
    def forward(ctx, x, weight, g):
        ctx.g = g
        ctx.save_for_backward(x, weight)
        return x @ weight.t()  # (..., k) @ (k, o) -> (..., o)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dy = grad.contiguous().view(-1, weight.shape[0])  # (M, o)
        dx = dy @ weight  # (M, o) @ (o, k) -> (M, k)
        reducing = comm.all_reduce(dx, op="sum", group=ctx.g, async_op=True)
        dw = dy.t() @ x.reshape(-1, x.shape[-1])  # (o, M) @ (M, k) -> (o, k), while dx is all-reduced
        reducing.wait()
        return dx.view(x.shape), dw, None


def all_gather_matmul(x_shard: torch.Tensor, weight: torch.Tensor, group=None) -> torch.Tensor:
    """``all_gather(x_shard, dim 0) @ weight.T`` with the gather split into ring
    steps under the matmuls. x_shard (m, ..., k), weight (o, k) -> (n*m, ..., o)."""
    g = tp_group(group)
    _check_matmul(x_shard, weight, "x_shard")
    return _AllGatherMatmul.apply(x_shard, weight, g)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group=None) -> torch.Tensor:
    """``reduce_scatter(x @ weight.T, dim 0)`` computed block by block with the
    partial sums passed around the ring. x (n*m, ..., k), weight (o, k) -> (m, ..., o)."""
    g = tp_group(group)
    _check_matmul(x, weight, "x")
    if x.shape[0] % g.size:
        raise ValueError(f"x: dim 0 (sequence length) {x.shape[0]} is not divisible by the tensor-parallel "
                         f"group size {g.size}; expected a multiple of {g.size}")
    return _MatmulReduceScatter.apply(x, weight, g)


def linear_async_all_reduce(x: torch.Tensor, weight: torch.Tensor, group=None) -> torch.Tensor:
    """``x @ weight.T`` whose backward all-reduces dx over the group while dw is computed."""
    g = tp_group(group)
    _check_matmul(x, weight, "x", min_dim=1)
    return _LinearAsyncAllReduce.apply(x, weight, g)
