"""Column- and row-parallel linear layers (Megatron-LM semantics).

A pair `ColumnParallelLinear -> (elementwise) -> RowParallelLinear` is one
tensor-parallel region: the column layer splits the output features (rows of
the weight), the row layer splits the input features (its columns), and the
only communication is at the two edges:

    no SP:  x (replicated) -f-> col -> act -> row -g-> y (replicated)
    SP:     x (seq/n, ...) -all-gather-> col -> act -> row -reduce-scatter-> y (seq/n, ...)

f/g are the conjugate ops of communications.py. With ``overlap=True`` the
edges run as the ring decompositions of overlap.py, whose backward overlaps the
weight-gradient matmul with the input-gradient communication.

Both layers initialise exactly like one ``nn.Linear(in_f, out_f)`` under the
same seed: every rank draws the full weight, then keeps its shard.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from ..bucketing import broadcast_coalesced
from . import communications as C
from . import overlap as O
from ..checks import check_bool, is_int


def _in_dtype_of(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The bias to add to y: under torch.autocast in y's (the autocast) dtype, as torch's linear adds it; else as
    it is."""
    if bias.dtype != y.dtype and torch.is_autocast_enabled(y.device.type):
        return bias.to(y.dtype)
    return bias


def _positive_int(value, arg: str) -> int:
    if not is_int(value):
        raise TypeError(f"{arg}: expected an int, got {type(value).__name__}")
    if not 1 <= value < 1 << 62:
        raise ValueError(f"{arg}: expected a positive int (below 2**62), got {value}")
    return value


def sync_replicated(tensors, group) -> None:
    """The group's first rank's values of tensors every rank of a TP group holds whole (a row layer's bias,
    a block's LayerNorms): their gradients are equal on every rank, so values drawn apart (ranks seeded
    differently) would stay apart."""
    if group.size == 1:
        return
    with torch.no_grad():  # (one broadcast per dtype; through copies on the group's device, where they are not)
        copies = [t.detach().to(group.tensor_device) for t in tensors]
        broadcast_coalesced(copies, group.ranks[0], group)
        for t, c in zip(tensors, copies):
            if c.data_ptr() != t.data_ptr():  # (a copy made for another device)
                t.copy_(c)


class _ParallelLinear(nn.Module):
    """Shared set-up of the two layers; `_split` names the weight dim that is sharded."""

    _split: int  # 0: output features (column), 1: input features (row)

    def _configure(self, in_f, out_f, sequence_parallel, overlap, group) -> None:
        self.in_features = _positive_int(in_f, "in_features")
        self.out_features = _positive_int(out_f, "out_features")
        self.group = C.tp_group(group)
        self.tp_size = self.group.size
        self.sequence_parallel = check_bool(sequence_parallel, "sequence_parallel")
        self.overlap = check_bool(overlap, "overlap")
        size, what = (out_f, "out_features") if self._split == 0 else (in_f, "in_features")
        self.shard = C.check_divisible(size, self.tp_size, what)

    def _agree(self, has_bias: bool) -> None:
        """Every rank of the TP group built the layer alike (sizes, flags, a bias or none): a rank whose shard
        is another size would compute a different layer without a word (a column layer's forward gathers
        nothing). One all_gather; a ValueError on every rank naming what differs."""
        if self.tp_size == 1:
            return
        names = ("in_features", "out_features", "sequence_parallel", "overlap",
                 "gather_output" if self._split == 0 else "input_is_parallel", "bias")
        extra = self.gather_output if self._split == 0 else self.input_is_parallel
        mine = [self.in_features, self.out_features, int(self.sequence_parallel), int(self.overlap), int(extra),
                int(has_bias)]
        rows = comm.every_rank(mine, group=self.group).tolist()
        for i, name in enumerate(names):
            values = [row[i] for row in rows]
            if len(set(values)) > 1:
                shown = ", ".join(f"rank {g}: {v if i < 2 else bool(v)}" for g, v in zip(self.group.ranks, values))
                raise ValueError(f"{type(self).__name__}: the ranks of the tensor-parallel group "
                                 f"{list(self.group.ranks)} built it with different {name} ({shown}); every rank "
                                 "builds the same layer")

    def _take_shard(self, linear: nn.Linear) -> None:
        self._agree(linear.bias is not None)
        r, k = self.group.rank, self.shard
        with torch.no_grad():
            w = linear.weight.detach()
            w = w[r * k:(r + 1) * k] if self._split == 0 else w[:, r * k:(r + 1) * k]
            # A frozen weight or bias stays frozen in its shard.
            self.weight = nn.Parameter(w.clone().contiguous(), requires_grad=linear.weight.requires_grad)
            self.weight.tp_sharded = True  # each TP rank holds a different part (clipping sums them)
            self.weight.tp_ranks = tuple(self.group.ranks)  # (data parallelism must not span two: wrappers)
            b = linear.bias
            if b is None:
                self.bias = None
            else:
                frozen = not b.requires_grad
                b = b.detach()[r * k:(r + 1) * k] if self._split == 0 else b.detach()
                self.bias = nn.Parameter(b.clone(), requires_grad=not frozen)
                self.bias.tp_sharded = self._split == 0  # a row layer's bias is replicated
                if self._split == 0:
                    self.bias.tp_ranks = tuple(self.group.ranks)
                else:
                    sync_replicated([self.bias], self.group)


    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **options):
        """This rank's shard of an existing ``nn.Linear`` (its values copied).
        ``options`` are the layer's other keyword arguments."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear: expected a torch.nn.Linear, got {type(linear).__name__}")
        allowed = [a for a in inspect.signature(cls._setup).parameters if a not in ("self", "in_f", "out_f", "group")]
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise TypeError(f"{cls.__name__}.from_linear: unknown option(s) {unknown} (the weight, bias and sizes "
                            f"come from `linear`); expected some of {allowed}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(linear.in_features, linear.out_features, group=group, **options)
        self._take_shard(linear)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"tp_size={self.tp_size}, sequence_parallel={self.sequence_parallel}, overlap={self.overlap}")


class ColumnParallelLinear(_ParallelLinear):
    """Splits the output features: this rank's weight is rows
    ``[rank * out_f/n, (rank+1) * out_f/n)`` and its output is that slice of
    the features (the whole of them with ``gather_output``). Input: replicated
    ``(..., in_f)``, or with ``sequence_parallel`` this rank's sequence slice
    ``(seq/n, ..., in_f)``, gathered along dim 0 before the matmul."""

    _split = 0

    def __init__(self, in_f: int, out_f: int, bias: bool = True, gather_output: bool = False,
                 sequence_parallel: bool = False, overlap: bool = True, group=None):
        super().__init__()
        self._setup(in_f, out_f, gather_output=gather_output, sequence_parallel=sequence_parallel,
                    overlap=overlap, group=group)
        self._take_shard(nn.Linear(in_f, out_f, bias=check_bool(bias, "bias")))  # the same RNG draws as one nn.Linear

    def _setup(self, in_f, out_f, gather_output=False, sequence_parallel=False, overlap=True, group=None):
        self._configure(in_f, out_f, sequence_parallel, overlap, group)
        check_bool(gather_output, "gather_output")
        if gather_output and self.sequence_parallel:
            raise ValueError("gather_output=True with sequence_parallel=True: the output of a sequence-parallel "
                             "column layer feeds a row layer; expected gather_output=False")
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.in_features:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"input: expected shape (..., {self.in_features}), got {shape}")
        g = self.group
        if self.sequence_parallel:
            if self.overlap:
                y = O.all_gather_matmul(x, self.weight, g)
            else:
                y = F.linear(C.gather_from_sp(x, g, reduce_grad=True), self.weight)
        elif self.overlap:
            y = O.linear_async_all_reduce(x, self.weight, g)
        else:
            y = F.linear(C.copy_to_tp(x, g), self.weight)
        if self.bias is not None:
            y = y + _in_dtype_of(self.bias, y)
        return C.gather_from_tp(y, g) if self.gather_output else y


class RowParallelLinear(_ParallelLinear):
    """Splits the input features: this rank's weight is columns
    ``[rank * in_f/n, (rank+1) * in_f/n)``; the partial products are summed
    (all-reduce), or with ``sequence_parallel`` summed and split along dim 0
    (reduce-scatter). The bias is replicated and added once, after the sum."""

    _split = 1

    def __init__(self, in_f: int, out_f: int, bias: bool = True, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, overlap: bool = True, group=None):
        super().__init__()
        self._setup(in_f, out_f, input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel,
                    overlap=overlap, group=group)
        self._take_shard(nn.Linear(in_f, out_f, bias=check_bool(bias, "bias")))  # the same RNG draws as one nn.Linear

    def _setup(self, in_f, out_f, input_is_parallel=True, sequence_parallel=False, overlap=True, group=None):
        self._configure(in_f, out_f, sequence_parallel, overlap, group)
        check_bool(input_is_parallel, "input_is_parallel")
        if not input_is_parallel and self.sequence_parallel:
            raise ValueError("input_is_parallel=False with sequence_parallel=True: a sequence-parallel row layer "
                             "takes the feature-split output of a column layer; expected input_is_parallel=True")
        self.input_is_parallel = input_is_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.group
        width = self.shard if self.input_is_parallel else self.in_features
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != width:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"input: expected shape (..., {width}) (in_features={self.in_features}"
                             f"{' split over ' + str(self.tp_size) + ' ranks' if self.input_is_parallel else ''}), "
                             f"got {shape}")
        if not self.input_is_parallel:
            x = C.scatter_to_tp(x, g)
        if not self.sequence_parallel:
            y = C.reduce_from_tp(F.linear(x, self.weight), g)
            return y + _in_dtype_of(self.bias, y) if self.bias is not None else y
        if self.overlap:
            y = O.matmul_reduce_scatter(x, self.weight, g)
        else:
            y = C.reduce_scatter_to_sp(F.linear(x, self.weight), g)
        if self.bias is not None:
            # Each rank adds the bias to its own tokens only: f sums the bias gradient over the group.
            y = y + C.copy_to_tp(_in_dtype_of(self.bias, y), g)
        return y
