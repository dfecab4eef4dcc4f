"""The Megatron conjugate communication ops, as autograd functions.

Tensor-parallel (TP) regions split features across the ranks of a TP group;
sequence-parallel (SP) regions split the sequence, dim 0, of the activations
between them. Each op below is one edge of such a region, and its backward is
the conjugate collective:

    op                              forward                 backward
    copy_to_tp (Megatron "f")       identity                all-reduce
    reduce_from_tp (Megatron "g")   all-reduce              identity
    scatter_to_tp                   split last dim          all-gather last dim
    gather_from_tp                  all-gather last dim     split last dim
    scatter_to_sp                   split dim 0             all-gather dim 0
    gather_from_sp                  all-gather dim 0        reduce-scatter dim 0 (or split)
    reduce_scatter_to_sp            reduce-scatter dim 0    all-gather dim 0

`group` is a pz Group (None: the world). Sizes that do not divide the group
size raise ValueError before any communication, identically on every rank.
"""
from __future__ import annotations

import torch

from .. import comm


def tp_group(group) -> comm.Group:
    """The pz Group for `group` (None: the world), checked to include this rank."""
    g = comm.resolve_group(group)
    if g.rank < 0:
        raise ValueError(f"group: this rank (global rank {comm.get_rank()}) is not a member of the "
                         f"tensor-parallel group {list(g.ranks)}")
    return g


def check_divisible(size: int, n: int, what: str) -> int:
    if size % n:
        raise ValueError(f"{what}={size} is not divisible by the tensor-parallel group size {n}; "
                         f"expected a multiple of {n}")
    return size // n


def _check_tensor(x, arg: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{arg}: expected a torch.Tensor, got {type(x).__name__}")


def _check_tp_input(x, arg: str) -> None:
    _check_tensor(x, arg)
    if x.dim() < 1:
        raise ValueError(f"{arg}: expected a tensor with a feature dim (the last) to split, got shape ()")


def _check_sp_input(x: torch.Tensor, arg: str) -> None:
    _check_tensor(x, arg)
    if x.dim() < 2:
        raise ValueError(f"{arg}: sequence parallelism splits dim 0 (the sequence) of a tensor with a feature "
                         f"dim after it; expected at least 2 dims, got shape {tuple(x.shape)}")


# ---------------------------------------------------------------------------
# Raw collectives along a tensor dim (no autograd)


def _ops():
    """torch.ops.pyzero (pyzero.ops), what a compiled region calls instead of the transport."""
    from .. import ops  # noqa: PLC0415  (registered on first use: see pyzero.ops)
    return ops


def all_gather_dim0(x: torch.Tensor, g: comm.Group) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _ops().all_gather_into_tensor(x, g.size, g.name)
    x = x.contiguous()
    out = x.new_empty((g.size * x.shape[0], *x.shape[1:]))
    comm.all_gather(out, x, group=g)
    return out


def reduce_scatter_dim0(x: torch.Tensor, g: comm.Group) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _ops().reduce_scatter_tensor(x, "sum", g.size, g.name)
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // g.size, *x.shape[1:]))
    comm.reduce_scatter(out, x, op="sum", group=g)
    return out


def split_dim0(x: torch.Tensor, g: comm.Group) -> torch.Tensor:
    m = x.shape[0] // g.size
    return x[g.rank * m:(g.rank + 1) * m].contiguous()


def all_gather_last(x: torch.Tensor, g: comm.Group) -> torch.Tensor:
    if torch.compiler.is_compiling():
        out = _ops().all_gather_into_tensor(x.unsqueeze(0), g.size, g.name)
    else:
        x = x.contiguous()
        out = x.new_empty((g.size, *x.shape))  # one contiguous block per rank, then laid side by side
        comm.all_gather(out, x, group=g)
    return torch.cat(out.unbind(0), dim=-1)


def split_last(x: torch.Tensor, g: comm.Group) -> torch.Tensor:
    m = x.shape[-1] // g.size
    return x[..., g.rank * m:(g.rank + 1) * m].contiguous()


def all_reduce_sum(x: torch.Tensor, g: comm.Group) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _ops().all_reduce(x, "sum", g.name)
    x = x.contiguous().clone()
    comm.all_reduce(x, op="sum", group=g)
    return x


# ---------------------------------------------------------------------------
# Autograd functions


class _CopyToTP(torch.autograd.Function):
    """Megatron f: entry of a TP region. Every rank uses the whole input, so its
    gradient is the sum of every rank's partial gradient."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_sum(grad, ctx.g), None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron g: exit of a TP region. Sums the partial outputs; each partial's
    gradient is the whole output gradient."""

    @staticmethod
    def forward(ctx, x, g):
        return all_reduce_sum(x, g)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    """Keeps this rank's slice of the last dim (a replicated input entering a
    row-parallel layer); the gradient is gathered back to full width."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return split_last(x, g)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_last(grad, ctx.g), None


class _GatherFromTP(torch.autograd.Function):
    """Concatenates every rank's slice of the last dim (column-parallel output to
    a replicated tensor); each rank keeps its slice of the gradient."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return all_gather_last(x, g)

    @staticmethod
    def backward(ctx, grad):
        return split_last(grad, ctx.g), None


class _ScatterToSP(torch.autograd.Function):
    """Enters an SP region from a replicated tensor: keep this rank's sequence slice."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return split_dim0(x, g)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.g), None


class _GatherFromSP(torch.autograd.Function):
    """SP -> whole sequence. With `reduce_grad` the consumer is a TP region whose
    ranks each hold a partial gradient (reduce-scatter it); otherwise the
    consumer is replicated and every rank holds the whole gradient (split it)."""

    @staticmethod
    def forward(ctx, x, g, reduce_grad):
        ctx.g, ctx.reduce_grad = g, reduce_grad
        return all_gather_dim0(x, g)

    @staticmethod
    def backward(ctx, grad):
        out = reduce_scatter_dim0(grad, ctx.g) if ctx.reduce_grad else split_dim0(grad, ctx.g)
        return out, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """Exit of a TP region into an SP region: sum the partial outputs, keep this
    rank's sequence slice; the gradient slices are gathered back."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return reduce_scatter_dim0(x, g)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.g), None


# ---------------------------------------------------------------------------
# Public wrappers: check shapes on every rank before communicating


def copy_to_tp(x, group=None):
    g = tp_group(group)
    _check_tensor(x, "input")
    return _CopyToTP.apply(x, g)


def reduce_from_tp(x, group=None):
    g = tp_group(group)
    _check_tensor(x, "input")
    return _ReduceFromTP.apply(x, g)


def scatter_to_tp(x, group=None):
    g = tp_group(group)
    _check_tp_input(x, "input")
    check_divisible(x.shape[-1], g.size, "input.shape[-1]")
    return _ScatterToTP.apply(x, g)


def gather_from_tp(x, group=None):
    g = tp_group(group)
    _check_tp_input(x, "input")
    return _GatherFromTP.apply(x, g)


def scatter_to_sp(x, group=None):
    g = tp_group(group)
    _check_sp_input(x, "input")
    check_divisible(x.shape[0], g.size, "input.shape[0] (sequence length)")
    return _ScatterToSP.apply(x, g)


_UNSET = object()


def gather_from_sp(x, group=None, reduce_grad=_UNSET):
    """The whole sequence from its sequence-parallel slices (all-gather along dim 0). ``reduce_grad``
    (required: no default fits both uses) is what the gradient of the result holds on each rank: True
    where the result enters a tensor-parallel region (each rank's gradient is a partial sum: reduce-scatter
    it), False where every rank computes the same thing with it (a replicated head or loss: each holds
    the whole gradient, so split it; a reduce-scatter would multiply it by the group size)."""
    if reduce_grad is _UNSET:
        raise TypeError("gather_from_sp: pass reduce_grad=False where every rank computes the same thing on the "
                        "result (a replicated head or loss), True where it enters a tensor-parallel region")
    if not isinstance(reduce_grad, bool):
        raise TypeError(f"reduce_grad: expected True or False, got {reduce_grad!r}")
    g = tp_group(group)
    _check_sp_input(x, "input")
    return _GatherFromSP.apply(x, g, bool(reduce_grad))


def reduce_scatter_to_sp(x, group=None):
    g = tp_group(group)
    _check_sp_input(x, "input")
    check_divisible(x.shape[0], g.size, "input.shape[0] (sequence length)")
    return _ReduceScatterToSP.apply(x, g)
