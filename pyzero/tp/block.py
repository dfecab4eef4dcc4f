"""A GPT-style transformer block and its tensor-parallel version.

`TransformerBlock` is the plain single-process model; `ParallelTransformerBlock.from_block`
shards one across a TP group: attention heads and MLP hidden units are split
(qkv and fc1 column-parallel, proj and fc2 row-parallel), LayerNorms are
replicated. Activations are (seq, batch, hidden); with sequence parallelism
each rank holds (seq/n, batch, hidden) outside the TP regions.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from . import communications as C
from .layers import ColumnParallelLinear, RowParallelLinear, sync_replicated
from ..checks import check_bool, is_int


def causal_attention(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """qkv (s, b, heads*3*d), laid out per head as [q | k | v] -> (s, b, heads*d).

    The per-head layout is what lets a column-parallel split of the qkv weight
    rows hand each rank whole heads."""
    if not is_int(heads) or heads < 1:
        raise ValueError(f"heads: expected a positive int, got {heads!r}")
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 3 or qkv.shape[-1] % (3 * heads) \
            or qkv.shape[-1] == 0:
        shape = tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__
        raise ValueError(f"qkv: expected shape (seq, batch, heads * 3 * head_dim) with heads={heads}, got {shape}")
    s, b, _ = qkv.shape
    q, k, v = qkv.view(s, b, heads, 3, -1).permute(3, 1, 2, 0, 4).unbind(0)  # 3 x (b, heads, s, d)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, s, d)
    return o.permute(2, 0, 1, 3).reshape(s, b, -1)  # (s, b, heads*d)


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: x + attn(ln1(x)), then + mlp(ln2(.))."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: int = 4):
        super().__init__()
        for arg, v in (("hidden", hidden), ("heads", heads), ("mlp_ratio", mlp_ratio)):
            if not is_int(v):
                raise TypeError(f"{arg}: expected an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"{arg}: expected a positive int, got {v}")
        if hidden % heads:
            raise ValueError(f"hidden={hidden} is not divisible by heads={heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, mlp_ratio * hidden)
        self.fc2 = nn.Linear(mlp_ratio * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(causal_attention(self.qkv(self.ln1(x)), self.heads))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class SequenceParallelLayerNorm(nn.LayerNorm):
    """A LayerNorm of a sequence-parallel region: each rank normalises only its tokens, and f
    (communications.copy_to_tp) sums the weight and bias gradients over the TP group. Its own
    forward reads the parameters, so that ZeRO stage 3 gathers them there as for any module."""

    @classmethod
    def from_layernorm(cls, ln: nn.LayerNorm, group) -> "SequenceParallelLayerNorm":
        new = copy.deepcopy(ln)
        new.__class__ = cls
        new.group = group
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (a LayerNorm without an affine weight or bias has nothing to sum)
        w = None if self.weight is None else C.copy_to_tp(self.weight, self.group)
        b = None if self.bias is None else C.copy_to_tp(self.bias, self.group)
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


class ParallelTransformerBlock(nn.Module):
    """This rank's part of a TransformerBlock: heads/n attention heads and
    mlp_hidden/n MLP units. Input and output are replicated (seq, b, hidden),
    or with ``sequence_parallel`` this rank's (seq/n, b, hidden) slice."""

    @classmethod
    def from_block(cls, block: TransformerBlock, group=None, sequence_parallel: bool = False,
                   overlap: bool = True) -> "ParallelTransformerBlock":
        if not isinstance(block, TransformerBlock):
            raise TypeError(f"block: expected a pz.tp.TransformerBlock, got {type(block).__name__}")
        return cls(block, group, sequence_parallel, overlap)

    def __init__(self, block: TransformerBlock, group, sequence_parallel: bool, overlap: bool):
        super().__init__()
        g = C.tp_group(group)
        self.heads = C.check_divisible(block.heads, g.size, "heads")
        self.group, self.sequence_parallel = g, check_bool(sequence_parallel, "sequence_parallel")
        check_bool(overlap, "overlap")
        opts = dict(group=g, sequence_parallel=sequence_parallel, overlap=overlap)
        # replicated input: every rank's LayerNorm gradient is already the whole one
        norm = (lambda ln: SequenceParallelLayerNorm.from_layernorm(ln, g)) if sequence_parallel else copy.deepcopy
        self.ln1 = norm(block.ln1)
        self.qkv = ColumnParallelLinear.from_linear(block.qkv, **opts)
        self.proj = RowParallelLinear.from_linear(block.proj, **opts)
        self.ln2 = norm(block.ln2)
        self.fc1 = ColumnParallelLinear.from_linear(block.fc1, **opts)
        self.fc2 = RowParallelLinear.from_linear(block.fc2, **opts)
        sync_replicated([t for ln in (self.ln1, self.ln2) for t in list(ln.parameters()) + list(ln.buffers())], g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(causal_attention(self.qkv(self.ln1(x)), self.heads))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
