"""pyzero's collectives as torch operators, ``torch.ops.pyzero.*``, for torch.compile.

Dynamo cannot trace into pyzero's C++ transport; it can put a torch custom operator
in a graph. Each operator here runs the same pyzero collective as the eager call
and has a fake (meta) implementation, so dynamo and AOTAutograd learn the shape
and dtype of its result without communicating. As in torch's functional
collectives (``torch.ops._c10d_functional``), a group travels by name (``Group.name``,
a string) and the collectives return new tensors; the ones that change tensors in
place say so (``mutates_args``) and are functionalised by AOTAutograd.

Operators (``group`` is a Group.name; ``group_size`` its size, as torch's take it):

    all_reduce(x, op, group) -> Tensor
    all_reduce_(x, op, group)                               (in place)
    all_gather_into_tensor(x, group_size, group) -> Tensor  (dim 0 concatenated)
    reduce_scatter_tensor(x, op, group_size, group) -> Tensor  (dim 0 split)
    broadcast(x, src, group) -> Tensor                      (src: a global rank)
    broadcast_coalesced_(tensors, src, group)               (in place, one message per dtype)
    all_gather_matmul(x, weight, group) -> Tensor           pz.tp.all_gather_matmul
    matmul_reduce_scatter(x, weight, group) -> Tensor       pz.tp.matmul_reduce_scatter
    linear_all_reduce(x, weight, group) -> Tensor           pz.tp.linear_async_all_reduce

all_gather_into_tensor and reduce_scatter_tensor are differentiable (each one's backward
is the other, as torch's ``*_autograd`` functional collectives); so are the three
tensor-parallel matmuls, whose backward operators (``*_backward``) run the
overlapped backward of pyzero.tp.overlap. all_reduce and broadcast are not: their
gradient depends on the model (pz.tp's f/g pair gives it).

pyzero imports this module on first use inside a compiled region (the
registration costs about 3 ms per operator, which ``import pyzero`` does not pay);
``import pyzero.ops`` registers them beforehand, e.g. to call them directly.
Eager code never goes through these operators: pz.tp, pz.DataParallel and the
collectives call the transport directly.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import bucketing, comm
from .tp import ring

__all__ = [
    "all_gather_into_tensor",
    "all_gather_matmul",
    "all_reduce",
    "all_reduce_",
    "broadcast",
    "broadcast_coalesced_",
    "linear_all_reduce",
    "matmul_reduce_scatter",
    "reduce_scatter_tensor",
]


def _group(name: str, group_size: int | None = None) -> comm.Group:
    g = comm.group_by_name(name)
    if group_size is not None and group_size != g.size:
        raise ValueError(f"group_size: group {name!r} has {g.size} ranks, got group_size={group_size}")
    return g


def _dim0(x: Tensor, arg: str) -> None:
    if x.dim() < 1:
        raise ValueError(f"{arg}: expected a tensor with at least one dim (dim 0 is split or gathered), "
                         f"got shape {tuple(x.shape)}")


# ---------------------------------------------------------------------------
# Collectives


@torch.library.custom_op("pyzero::all_reduce", mutates_args=())
def all_reduce(x: Tensor, op: str, group: str) -> Tensor:
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    comm.all_reduce(x.contiguous(), op=op, group=_group(group), out=out)
    return out


@all_reduce.register_fake
def _(x, op, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("pyzero::all_reduce_", mutates_args=("x",))
def all_reduce_(x: Tensor, op: str, group: str) -> None:
    if x.is_contiguous():
        comm.all_reduce(x, op=op, group=_group(group))
    else:
        x.copy_(all_reduce(x, op, group))


@all_reduce_.register_fake
def _(x, op, group):
    return None


@torch.library.custom_op("pyzero::all_gather_into_tensor", mutates_args=())
def all_gather_into_tensor(x: Tensor, group_size: int, group: str) -> Tensor:
    g = _group(group, group_size)
    _dim0(x, "x")
    x = x.contiguous()
    out = x.new_empty((group_size * x.shape[0], *x.shape[1:]))
    comm.all_gather(out, x, group=g)
    return out


@all_gather_into_tensor.register_fake
def _(x, group_size, group):
    _dim0(x, "x")
    return x.new_empty((group_size * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("pyzero::reduce_scatter_tensor", mutates_args=())
def reduce_scatter_tensor(x: Tensor, op: str, group_size: int, group: str) -> Tensor:
    g = _group(group, group_size)
    _dim0(x, "x")
    _check_split(x, group_size)
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // group_size, *x.shape[1:]))
    comm.reduce_scatter(out, x, op=op, group=g)
    return out


def _check_split(x: Tensor, group_size: int) -> None:
    if x.shape[0] % group_size:
        raise ValueError(f"x: dim 0 ({x.shape[0]}) is not divisible by the group size {group_size}")


@reduce_scatter_tensor.register_fake
def _(x, op, group_size, group):
    _dim0(x, "x")
    _check_split(x, group_size)
    return x.new_empty((x.shape[0] // group_size, *x.shape[1:]))


def _all_gather_backward(ctx, grad):
    return reduce_scatter_tensor(grad, "sum", ctx.group_size, ctx.group), None, None


def _reduce_scatter_backward(ctx, grad):
    if ctx.op != "sum":
        raise RuntimeError(f"pyzero::reduce_scatter_tensor: backward is defined for op='sum', got op={ctx.op!r}")
    return all_gather_into_tensor(grad, ctx.group_size, ctx.group), None, None, None


def _keep_group(ctx, inputs, output):
    ctx.group_size, ctx.group = inputs[-2], inputs[-1]
    if len(inputs) == 4:
        ctx.op = inputs[1]


all_gather_into_tensor.register_autograd(_all_gather_backward, setup_context=_keep_group)
reduce_scatter_tensor.register_autograd(_reduce_scatter_backward, setup_context=_keep_group)


@torch.library.custom_op("pyzero::broadcast", mutates_args=())
def broadcast(x: Tensor, src: int, group: str) -> Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    comm.broadcast(out, src=src, group=_group(group))
    return out


@broadcast.register_fake
def _(x, src, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("pyzero::broadcast_coalesced_", mutates_args=("tensors",))
def broadcast_coalesced_(tensors: list[Tensor], src: int, group: str) -> None:
    if tensors:
        bucketing.broadcast_coalesced(tensors, src, _group(group))


@broadcast_coalesced_.register_fake
def _(tensors, src, group):
    return None


# ---------------------------------------------------------------------------
# The tensor-parallel matmuls of pyzero.tp.overlap


def _matmul_shape(x, weight, rows: int) -> tuple:
    return (rows, *x.shape[1:-1], weight.shape[0])


@torch.library.custom_op("pyzero::all_gather_matmul", mutates_args=())
def all_gather_matmul(x: Tensor, weight: Tensor, group: str) -> Tensor:
    return ring.all_gather_matmul_forward(x, weight, _group(group))


@all_gather_matmul.register_fake
def _(x, weight, group):
    return x.new_empty(_matmul_shape(x, weight, _group(group).size * x.shape[0]))


@torch.library.custom_op("pyzero::all_gather_matmul_backward", mutates_args=())
def all_gather_matmul_backward(grad: Tensor, x: Tensor, weight: Tensor, group: str) -> tuple[Tensor, Tensor]:
    return ring.all_gather_matmul_backward(grad, x, weight, _group(group))


@torch.library.custom_op("pyzero::matmul_reduce_scatter", mutates_args=())
def matmul_reduce_scatter(x: Tensor, weight: Tensor, group: str) -> Tensor:
    return ring.matmul_reduce_scatter_forward(x, weight, _group(group))


@matmul_reduce_scatter.register_fake
def _(x, weight, group):
    return x.new_empty(_matmul_shape(x, weight, x.shape[0] // _group(group).size))


@torch.library.custom_op("pyzero::matmul_reduce_scatter_backward", mutates_args=())
def matmul_reduce_scatter_backward(grad: Tensor, x: Tensor, weight: Tensor, group: str) -> tuple[Tensor, Tensor]:
    return ring.matmul_reduce_scatter_backward(grad, x, weight, _group(group))


@torch.library.custom_op("pyzero::linear_all_reduce", mutates_args=())
def linear_all_reduce(x: Tensor, weight: Tensor, group: str) -> Tensor:
    return x @ weight.t()


@linear_all_reduce.register_fake
def _(x, weight, group):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("pyzero::linear_all_reduce_backward", mutates_args=())
def linear_all_reduce_backward(grad: Tensor, x: Tensor, weight: Tensor, group: str) -> tuple[Tensor, Tensor]:
    return ring.linear_all_reduce_backward(grad, x, weight, _group(group))


@all_gather_matmul_backward.register_fake
@matmul_reduce_scatter_backward.register_fake
@linear_all_reduce_backward.register_fake
def _(grad, x, weight, group):
    # contiguous, whatever the strides of x and weight, as the kernels make them (pyzero.tp.ring): a
    # compiled graph checks the strides its fake kernels promised
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _save_matmul(ctx, inputs, output):
    x, weight, group = inputs
    ctx.save_for_backward(x, weight)
    ctx.group = group


def _backward_with(op):
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dx, dw = op(grad, x, weight, ctx.group)
        return dx, dw, None
    return backward


all_gather_matmul.register_autograd(_backward_with(all_gather_matmul_backward), setup_context=_save_matmul)
matmul_reduce_scatter.register_autograd(_backward_with(matmul_reduce_scatter_backward), setup_context=_save_matmul)
linear_all_reduce.register_autograd(_backward_with(linear_all_reduce_backward), setup_context=_save_matmul)
