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

import contextlib

import torch

from .communications import tp_group
from . import ring as R
from .ring import (  # noqa: F401  (the ring helpers, also used from here)
    gather_blocks,
    reduce_scatter_blocks,
    ring_all_gather,
    ring_matmul_reduce_scatter,
    ring_reduce_scatter,
)


def _autocast(x, weight):
    """Under torch.autocast the overlapped matmuls compute in its dtype, as torch's linear does: x and the weight
    are cast first (autograd ops: an fp32 weight gets its gradient in fp32), and the op runs with autocast off (its
    matmuls write into buffers, where autocast does not cast, and its backward must not mix dtypes)."""
    # (float64 is never cast, as autocast's own ops leave it: a float64 layer stays float64)
    if isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and x.is_floating_point() \
            and weight.is_floating_point() and torch.float64 not in (x.dtype, weight.dtype) \
            and x.device.type in ("cpu", "cuda"):  # (autocast knows no "meta": the checks below name it)
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            return x.to(dt), weight.to(dt), torch.autocast(dev, enabled=False)
    return x, weight, contextlib.nullcontext()


def _check_matmul(x, weight, x_arg: str, min_dim: int = 2):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{x_arg}: expected a torch.Tensor, got {type(x).__name__}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight: expected a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2 or 0 in weight.shape:
        raise ValueError(f"weight: expected 2 dims (out_features, in_features), neither 0, got shape "
                         f"{tuple(weight.shape)}")
    if x.dim() < min_dim or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{x_arg}: expected shape (rows, ..., {weight.shape[1]}) to match weight "
                         f"{tuple(weight.shape)}, got {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"{x_arg}: dtype {x.dtype} does not match weight's {weight.dtype}")


def _ops():
    """torch.ops.pyzero (pyzero.ops): a compiled region runs each op below as one operator."""
    from .. import ops  # noqa: PLC0415  (registered on first use: see pyzero.ops)
    return ops


class _AllGatherMatmul(torch.autograd.Function):
    """Column-parallel linear in an SP region: y = all_gather(x_shard) @ w.T.

    Backward (Megatron: the gathered input is not kept; it is gathered again):
        Before:  | gather x | dx = dy @ w | reduce-scatter dx | dw = dy.T @ x |
        Now:     dx = reduce-scatter of (dy @ w) block by block, as matmul_reduce_scatter
                 does; then x is gathered block by block and dw += dy[c].T @ x[c] for
                 each block c as soon as it is here.
    (ring.all_gather_matmul_forward / _backward)
    """

    @staticmethod
    def forward(ctx, x_shard, weight, g):
        ctx.g = g
        ctx.save_for_backward(x_shard, weight)
        return R.all_gather_matmul_forward(x_shard, weight, g)

    @staticmethod
    def backward(ctx, grad):
        x_shard, weight = ctx.saved_tensors
        dx, dw = R.all_gather_matmul_backward(grad, x_shard, weight, ctx.g)
        return dx, dw, None


class _MatmulReduceScatter(torch.autograd.Function):
    """Row-parallel linear into an SP region: y = reduce_scatter(x @ w.T).

    Backward: dy is all-gathered around the ring, and for each block c as it
    arrives both gradients' pieces are computed:
        Before:  | gather dy | dx = dy @ w | dw = dy.T @ x |
        Now:     send/recv | block c-1 in flight                 | ...
                 mm        | dx[c] = dy[c] @ w; dw += dy[c].T @ x[c] | ...
    (ring.matmul_reduce_scatter_forward / _backward)
    """

    @staticmethod
    def forward(ctx, x, weight, g):
        ctx.g = g
        ctx.save_for_backward(x, weight)
        return R.matmul_reduce_scatter_forward(x, weight, g)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dx, dw = R.matmul_reduce_scatter_backward(grad, x, weight, ctx.g)
        return dx, dw, None


class _LinearAsyncAllReduce(torch.autograd.Function):
    """Column-parallel linear without SP: y = x @ w.T (x replicated), i.e.
    Megatron's f followed by the matmul, with f's all-reduce overlapped.

    Backward:
        Before:  | dx = dy @ w | all-reduce dx | dw = dy.T @ x |
        Now:     mm   | dx = dy @ w | dw = dy.T @ x |
                 comm               | all-reduce dx |
    (ring.linear_all_reduce_backward)
    """

    @staticmethod
    def forward(ctx, x, weight, g):
        ctx.g = g
        ctx.save_for_backward(x, weight)
        return x @ weight.t()  # (..., k) @ (k, o) -> (..., o)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dx, dw = R.linear_all_reduce_backward(grad, x, weight, ctx.g)
        return dx, dw, None


def all_gather_matmul(x_shard: torch.Tensor, weight: torch.Tensor, group=None) -> torch.Tensor:
    """``all_gather(x_shard, dim 0) @ weight.T`` with the gather split into ring
    steps under the matmuls. x_shard (m, ..., k), weight (o, k) -> (n*m, ..., o)."""
    g = tp_group(group)
    x_shard, weight, autocast_off = _autocast(x_shard, weight)
    _check_matmul(x_shard, weight, "x_shard")
    with autocast_off:
        if torch.compiler.is_compiling():
            return _ops().all_gather_matmul(x_shard, weight, g.name)
        return _AllGatherMatmul.apply(x_shard, weight, g)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group=None) -> torch.Tensor:
    """``reduce_scatter(x @ weight.T, dim 0)`` computed block by block with the
    partial sums passed around the ring. x (n*m, ..., k), weight (o, k) -> (m, ..., o)."""
    g = tp_group(group)
    x, weight, autocast_off = _autocast(x, weight)
    _check_matmul(x, weight, "x")
    if x.shape[0] % g.size:
        raise ValueError(f"x: dim 0 (sequence length) {x.shape[0]} is not divisible by the tensor-parallel "
                         f"group size {g.size}; expected a multiple of {g.size}")
    with autocast_off:
        if torch.compiler.is_compiling():
            return _ops().matmul_reduce_scatter(x, weight, g.name)
        return _MatmulReduceScatter.apply(x, weight, g)


def linear_async_all_reduce(x: torch.Tensor, weight: torch.Tensor, group=None) -> torch.Tensor:
    """``x @ weight.T`` whose backward all-reduces dx over the group while dw is computed."""
    g = tp_group(group)
    x, weight, autocast_off = _autocast(x, weight)
    _check_matmul(x, weight, "x", min_dim=1)
    with autocast_off:
        if torch.compiler.is_compiling():
            return _ops().linear_all_reduce(x, weight, g.name)
        return _LinearAsyncAllReduce.apply(x, weight, g)
